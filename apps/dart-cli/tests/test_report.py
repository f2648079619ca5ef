"""``dart report``: the viewer's pages as static files, on a synthetic run directory written with the real
telemetry writers and schema."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
import typer
from sqlalchemy import create_engine, insert
from typer.testing import CliRunner

from dart.cli import report
from dart.cli.report.load import load_run
from dart.cli.report.plots import Plot, kind_timeline, plot_utilization, rolling_rate
from dart.cli.stack.summary import utilization_by_kind
from dart.data.schema import migrate, trajectories
from dart.runtime.telemetry import BusyInterval, observed_window

pytestmark = pytest.mark.unit

PLOT_TITLES = 7
"""The plots of a run with every piece (two success plots, held-out, utilization, staleness, training, updates)."""


def _app() -> typer.Typer:
    # A private app: the command under test without depending on main.py's module list.
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Test root (makes ``report`` a subcommand)."""

    report.register(app)
    return app


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(_app(), ["report", *args])
    return result.exit_code, result.stdout, result.stderr


def _write_index(run_dir: Path, t0: float) -> None:
    engine = create_engine(f"sqlite:///{run_dir / 'data.sqlite3'}")
    migrate(engine)
    rows = []
    for i in range(40):
        status = ("ok", "ok", "truncated", "aborted", "ok")[i % 5]
        rows.append(
            {
                "trajectory_id": f"t{i}",
                "work_id": f"w{i}",
                "task_id": f"task-{i % 4}",
                "group_id": f"g{i // 4}",
                "rollout_index": i % 4,
                "group_size": 4,
                "status": status,
                "reward": float(i > 20),
                "success": i > 20 and status != "aborted",
                "num_steps": 5,
                "parse_errors": 0,
                "mean_entropy": 1.0,
                "min_policy_version": i // 10,
                "max_policy_version": i // 8,
                "started_at": t0 + i - 1,
                "finished_at": t0 + i,
                "blob_key": f"trajectories/t{i}.json",
                "blob_uri": f"file:///a/t{i}.json",
                "ingested_at": t0 + i,
                "pooled": i == 39,
            }
        )
    with engine.begin() as conn:
        conn.execute(insert(trajectories), rows)
    engine.dispose()


@pytest.fixture
def run_dir(tmp_path: Path, kit: Any) -> Iterator[Path]:
    root = tmp_path / "run-1"
    root.mkdir()
    (root / "config.yaml").write_text("run:\n  name: r1\ntrain:\n  lr: 1.0e-06\n  publish_every: 2\n")
    (root / "summary.json").write_text(json.dumps({"versions_published": 5, "ok": True}))
    clock = kit.clock()
    t0 = clock.now / 1e9
    kit.write_telemetry(root, clock)
    _write_index(root, t0)
    yield root


def _links(page: Path) -> list[str]:
    """Every href and src of a page that is not an anchor or a data URI."""
    found = re.findall(r'(?:href|src)="([^"#]+)"', page.read_text())
    return [link for link in found if not link.startswith("data:")]


def test_full_report(run_dir: Path) -> None:
    code, out, err = invoke(str(run_dir))
    assert code == 0, err
    target = run_dir / "report" / "index.html"
    assert out.splitlines()[0] == str(target)
    # The overview, the list, 40 trajectories and their 10 groups; no image (the blobs are not in the store).
    written = {"report": str(target), "pages": 52, "images": 0, "plots": PLOT_TITLES, "missing_images": 0}
    assert json.loads(out.strip().splitlines()[-1]) == written
    page = target.read_text()
    assert len(re.findall(r'<img src="plots/\d+.png"', page)) == PLOT_TITLES
    assert "<tr><th>versions_published</th><td>5</td></tr>" in page
    # Held-out success by version, with intervals; the latest on its card.
    assert '<td class="n">5</td><td class="n">50.0%</td><td class="n">34.0%–66.0%</td><td class="n">32</td>' in page
    assert "held-out success of v5 (n=32; 95% CI 34.0%–66.0%)" in page
    # Utilization over the span the telemetry covers (the summary recorded no RL window): the summary's function.
    assert "the span the telemetry covers" in page
    window = observed_window(run_dir / "telemetry")
    assert window is not None
    expected = utilization_by_kind(run_dir / "telemetry", *window)
    for kind in ("env", "engine", "trainer"):
        assert f'<td class="n util-{kind}">{100 * expected[kind]:.1f}%</td>' in page
    assert "latest version published (5 published)" in page
    # Static pages: no filter form, and every link is a file of the report.
    listing = (run_dir / "report" / "trajectories.html").read_text()
    assert 'id="filters"' not in listing and 'id="static-note"' in listing
    for html in (run_dir / "report").glob("*.html"):
        for link in _links(html):
            assert not link.startswith("/") and "?" not in link, (html.name, link)
            assert (run_dir / "report" / unquote(link)).is_file(), (html.name, link)
    # A trajectory whose blob is not in the store is a page saying so, with the index's row.
    traj = (run_dir / "report" / "trajectory-t3.html").read_text()
    assert 'id="error"' in traj and "status aborted" in traj


def test_a_report_of_trajectories_with_screenshots(view_run: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, err = invoke(str(view_run.run_dir), "--out", str(out), "--trajectories", "3")
    assert code == 0, err
    figures = json.loads(stdout.strip().splitlines()[-1])
    assert figures["images"] > 0 and figures["missing_images"] == 0
    pages = sorted(p.name for p in out.glob("trajectory-*.html"))
    assert len(pages) == 3
    for page in pages:
        shots = [link for link in _links(out / page) if link.startswith("images/")]
        assert shots, page
        for link in shots:  # the store's bytes, copied
            key = unquote(unquote(link).removeprefix("images/"))  # a file named by its quoted key
            assert (out / unquote(link)).read_bytes() == view_run.path_of(key).read_bytes()
    # A second report into the same directory replaces the first one's pages.
    code, _, err = invoke(str(view_run.run_dir), "--out", str(out), "--trajectories", "1")
    assert code == 0, err
    assert len(list(out.glob("trajectory-*.html"))) == 1


def test_a_deployment_report_needs_somewhere_to_write(tmp_path: Path) -> None:
    code, _, err = invoke("--config", str(tmp_path / "run.yaml"))
    assert code == 2 and "give --out DIR with --config" in err


def test_loads_what_was_written(run_dir: Path) -> None:
    data = load_run(run_dir)
    assert data.problems == []
    assert len(data.trajectories) == 40 and data.trajectories[-1].pooled
    assert [t.finished_at for t in data.trajectories] == sorted(t.finished_at for t in data.trajectories)
    assert len(data.event_list("trainer.step")) == 10
    assert len(data.event_list("engine.update.end")) == 10
    assert len(data.event_list("engine.update.start")) == 11
    assert {k: len({i.resource_id for i in v}) for k, v in data.busy.items()} == {"env": 3, "engine": 1, "trainer": 1}
    assert data.duration_s == pytest.approx(40.0, abs=1.0)


def test_missing_pieces_give_notes_not_crashes(tmp_path: Path) -> None:
    root = tmp_path / "crashed"
    root.mkdir()
    (root / "config.yaml").write_text("run:\n  name: crashed\n")
    migrate(create_engine(f"sqlite:///{root / 'data.sqlite3'}"))
    out_dir = tmp_path / "elsewhere"
    code, out, err = invoke(str(root), "--out", str(out_dir))
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["plots"] == 0
    page = (out_dir / "index.html").read_text()
    assert "No trainer.step events" in page and "no summary.json" in page
    assert "telemetry does not exist" in page


def test_unreadable_database_is_noted(tmp_path: Path) -> None:
    root = tmp_path / "r"
    root.mkdir()
    (root / "data.sqlite3").write_bytes(b"not a database at all" * 100)
    data = load_run(root)
    assert data.trajectories == [] and any("data.sqlite3 could not be read" in p for p in data.problems)


def test_not_a_run_dir_exits_2(tmp_path: Path) -> None:
    code, _, err = invoke(str(tmp_path))
    assert code == 2 and "it has no config.yaml" in err
    code, _, err = invoke(str(tmp_path / "absent"))
    assert code == 2 and "no such directory" in err


def test_rolling_rate() -> None:
    assert rolling_rate([True, False, True, True], 2) == [1.0, 0.5, 0.5, 1.0]
    assert rolling_rate([], 3) == []


def test_kind_timeline_averages_instances() -> None:
    items = [BusyInterval("env", "a", "step", 0, 10), BusyInterval("env", "b", "step", 5, 10)]
    assert kind_timeline(items, 0, 10, 5) == [(0, 0.5), (5, 1.0)]


def test_utilization_plot_is_a_png(run_dir: Path) -> None:
    plot = plot_utilization(load_run(run_dir))
    assert isinstance(plot, Plot) and plot.png.startswith(b"\x89PNG\r\n\x1a\n")
