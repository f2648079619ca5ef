"""``dart view``'s index queries, its read-only access, the action overlay and the command itself."""

from __future__ import annotations

import hashlib
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.exc import InternalError, OperationalError
from typer.testing import CliRunner

from dart.cli.main import app
from dart.cli.view.errors import NotARunError
from dart.cli.view.overlay import action_shapes, describe
from dart.cli.view.queries import PAGE_SIZE, RunIndex, TrajectoryFilter, read_only_engine
from dart.cli.view.source import open_run
from dart.data.index import TrajectoryIndex
from dart.data.schema import LATEST_VERSION
from dart.env.sim.interaction import to_pixel
from dart.protocol import messages as m

pytestmark = pytest.mark.unit


def test_the_index_is_opened_read_only_and_left_as_it_was(view_run: Any) -> None:
    db = view_run.run_dir / "data.sqlite3"
    view_run.index.close()
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    index = RunIndex(read_only_engine(f"sqlite:///{db}"))
    index.check_schema()
    assert index.overview().total == 7
    with index.engine.connect() as conn, pytest.raises(OperationalError, match="readonly"):
        conn.execute(text("CREATE TABLE intruder (a INTEGER)"))
    index.close()
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


def test_a_postgresql_index_is_read_in_read_only_transactions(postgres_url: str) -> None:
    writer = TrajectoryIndex(postgres_url)
    writer.migrate()
    writer.close()
    index = RunIndex(read_only_engine(postgres_url))
    index.check_schema()
    assert index.overview().total == 0
    with index.engine.connect() as conn, pytest.raises(InternalError, match="read-only transaction"):
        conn.execute(text("CREATE TABLE intruder (a INTEGER)"))
    index.close()


def test_an_index_of_another_schema_version_is_refused_not_migrated(view_run: Any) -> None:
    with view_run.index.engine.begin() as conn:
        conn.execute(text("DELETE FROM schema_version WHERE version = :v"), {"v": LATEST_VERSION})
    index = RunIndex(read_only_engine(view_run.index.url))
    said = f"schema version {LATEST_VERSION - 1} and this dart view reads version {LATEST_VERSION}"
    with pytest.raises(NotARunError, match=said):
        index.check_schema()


def test_keyset_pages_follow_the_primary_key_whatever_the_filter(tmp_path: Path, kit: Any) -> None:
    run = kit.new_run(tmp_path / "run")
    for i in range(130):
        status = m.TrajectoryStatus.OK if i % 3 else m.TrajectoryStatus.ABORTED
        run.add(kit.make_traj(f"t-{i:03d}", f"g-{i // 10}", i % 10, status=status, reward=float(i % 2), actions=()))
    index = RunIndex(read_only_engine(run.index.url))
    seen: list[str] = []
    page = index.page(TrajectoryFilter(status="ok"))
    while True:
        seen += [r["trajectory_id"] for r in page.rows]
        assert len(page.rows) <= PAGE_SIZE and page.total == 86
        if page.next_after is None:
            break
        page = index.page(TrajectoryFilter(status="ok"), after=page.next_after)
    assert seen == [f"t-{i:03d}" for i in range(130) if i % 3]
    back = index.page(TrajectoryFilter(status="ok"), before=seen[60])
    assert [r["trajectory_id"] for r in back.rows] == seen[10:60] and back.prev_before == seen[10]
    assert index.neighbours("t-050") == ("t-049", "t-051") and index.neighbours("t-000")[0] is None
    both = index.page(TrajectoryFilter(group_id="g-3", success=True, min_version=1, max_version=1))
    assert [r["trajectory_id"] for r in both.rows] == ["t-031", "t-033", "t-035", "t-037", "t-039"]
    index.close()
    run.index.close()


def test_the_query_plans_use_the_indexes(view_run: Any) -> None:
    """Pages walk the primary key (no sort of the table); task and group filters use their indexes."""
    engine = read_only_engine(view_run.index.url)
    with engine.connect() as conn:

        def plan(sql: str) -> str:
            return " | ".join(str(r[-1]) for r in conn.execute(text("EXPLAIN QUERY PLAN " + sql)))

        walk = plan(
            "SELECT trajectory_id FROM trajectories WHERE status = 'ok' AND trajectory_id > 'x' "
            "ORDER BY trajectory_id LIMIT 51"
        )
        assert "sqlite_autoindex_trajectories_1" in walk and "TEMP B-TREE" not in walk
        assert "ix_trajectories_group_id" in plan("SELECT * FROM trajectories WHERE group_id = 'g-a'")
        assert "USING INDEX ix_trajectories_" in plan("SELECT * FROM trajectories WHERE task_id = 't'")
    engine.dispose()


W, H = 1920, 1080


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (m.Click(x=0.5, y=0.25), [("point", 960.0, 270.0, "click")]),
        (m.DoubleClick(x=0.0, y=1.0), [("point", 0.0, 1080.0, "double_click")]),
        (m.RightClick(x=0.1, y=0.1), [("point", 192.0, 108.0, "right_click")]),
        (
            m.Drag(x1=0.1, y1=0.2, x2=0.3, y2=0.4),
            [("line", 192.0, 216.0, "drag"), ("point", 192.0, 216.0, "drag"), ("point", 576.0, 432.0, "drag")],
        ),
    ],
)
def test_points_land_on_the_pixel_the_env_acts_on(action: m.Action, expected: list[tuple[Any, ...]]) -> None:
    shapes = action_shapes(action, W, H)
    assert [(s.kind, pytest.approx(s.x), pytest.approx(s.y), s.role) for s in shapes] == expected
    # The marker's centre (a click's point, a drag's start) lies in the pixel the sim env acts on.
    centre = next(s for s in shapes if s.kind == "point")
    x, y = (action.x1, action.y1) if isinstance(action, m.Drag) else (action.x, action.y)  # type: ignore[union-attr]
    assert (min(W - 1, int(centre.x)), min(H - 1, int(centre.y))) == to_pixel(x, y, W, H)


def test_actions_without_a_point_are_labels() -> None:
    labels = {
        m.Type(text="hi\n"): "type: hi⏎",
        m.Hotkey(keys=("ctrl", "shift", "t")): "keys: ctrl + shift + t",
        m.Wait(seconds=2): "wait 2 s",
        m.Finished(content="42"): "finished: 42",
        m.Fail(reason="no such button"): "fail: no such button",
    }
    for action, caption in labels.items():
        (shape,) = action_shapes(action, W, H)
        assert (shape.kind, shape.text) == ("label", caption)
        assert describe(action) == caption
    scroll = action_shapes(m.Scroll(x=0.5, y=0.5, direction=m.ScrollDirection.LEFT, amount=2), W, H)
    assert [s.kind for s in scroll] == ["point", "line", "label"] and scroll[1].x2 < scroll[1].x
    assert action_shapes(None, W, H) == [] and describe(None).startswith("no action")


def test_what_is_not_a_run_is_a_clear_command_error(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(app, ["view", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no such directory" in missing.output
    (tmp_path / "config.yaml").write_text("run: {name: x}\n")
    no_index = runner.invoke(app, ["view", str(tmp_path)])
    assert no_index.exit_code == 2 and "no data.sqlite3" in no_index.output
    neither = runner.invoke(app, ["view"])
    assert neither.exit_code == 2 and "give a run directory or --config" in neither.output
    with pytest.raises(NotARunError, match="no such file"), open_run(config=tmp_path / "run.yaml"):
        pass


@pytest.mark.integration
def test_the_command_prints_its_url_serves_and_stops(view_run: Any) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dart.cli", "view", str(view_run.run_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/"), proc.stderr
        assert "training success (1 of 4 trainable" in httpx.get(url, timeout=30).text
        assert httpx.get(url + "trajectories/traj-g-a-0", timeout=30).status_code == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


@pytest.mark.integration
def test_beyond_loopback_the_viewer_needs_its_token_on_every_request(view_run: Any, tmp_path: Path) -> None:
    """Served on every interface, only requests with the token (bearer, or the cookie a ``?token=`` visit sets)
    read the run; without ``--token`` it does not start."""
    command = [sys.executable, "-m", "dart.cli", "view", str(view_run.run_dir), "--host", "0.0.0.0", "--port", "0"]
    beyond = ["view", str(view_run.run_dir), "--host", "0.0.0.0", "--port", "0"]
    refused = CliRunner().invoke(app, beyond)
    assert refused.exit_code == 2 and "needs --token TOKEN_FILE" in refused.output
    token_file = tmp_path / "view.token"
    token_file.write_text("short\n")
    weak = CliRunner().invoke(app, [*beyond, "--token", str(token_file)])
    assert weak.exit_code == 2 and "at least 16" in weak.output
    token = secrets.token_urlsafe(32)
    token_file.write_text(token + "\n")
    proc = subprocess.Popen(
        [*command, "--token", str(token_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        served = proc.stdout.readline().strip()
        assert served.startswith("http://0.0.0.0:") and token not in served, proc.stderr
        url = served.replace("0.0.0.0", "127.0.0.1")
        pages = ["", "trajectories", "trajectories/traj-g-a-0", "static/view.css"]
        for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Cookie": f"dart_view_token={token}"}):
            for page in pages:
                answer = httpx.get(url + page, headers=headers, timeout=30)
                assert answer.status_code == 401 and "traj-g-a" not in answer.text, (page, headers)
        assert httpx.get(url + "trajectories?token=not-the-token", timeout=30).status_code == 401
        bearer = httpx.get(url + "trajectories/traj-g-a-0", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert bearer.status_code == 200
        # A browser: one visit with ?token= sets the cookie and drops the token from the address.
        with httpx.Client(timeout=30) as browser:
            first = browser.get(url + f"trajectories?status=ok&token={token}")
            assert first.status_code == 303 and first.headers["location"] == "/trajectories?status=ok"
            assert "httponly" in first.headers["set-cookie"].lower() and token not in first.headers["set-cookie"]
            assert browser.get(url + "trajectories/traj-g-a-0").status_code == 200
            assert "training success" in browser.get(url).text
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
