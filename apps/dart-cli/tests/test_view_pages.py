"""``dart view``'s pages on a run directory written by dart-data itself, served with starlette's TestClient."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from html import escape
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from dart.cli.stack.run_record import RL_WINDOW_FILE
from dart.cli.stack.summary import utilization_by_kind
from dart.cli.view.app import create_app
from dart.cli.view.figures import QUIET_S
from dart.cli.view.source import open_run
from dart.data.advantages import group_advantages
from dart.protocol import messages as m
from dart.runtime.telemetry import observed_window

pytestmark = pytest.mark.unit

LOCAL = "http://127.0.0.1"
"""Where the test client addresses the viewer (it answers to loopback names only)."""


@pytest.fixture
def client(view_run: Any) -> Iterator[TestClient]:
    with open_run(view_run.run_dir) as source, TestClient(create_app(source), base_url=LOCAL) as c:
        yield c


def _ids(html: str) -> list[str]:
    return re.findall(r'<a class="trajectory" href="/trajectories/[^"]+">([^<]+)</a>', html)


def test_overview_counts_from_the_index(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    html = page.text
    by_status = html[html.index('id="by-status"') : html.index("</table>", html.index('id="by-status"'))]
    assert re.findall(r">(\w+)</a></td><td class=\"n\">(\d+)<", by_status) == [
        ("ok", "4"),
        ("aborted", "1"),
        ("failed", "1"),
        ("truncated", "1"),
    ]
    # Trainable and not pooled, as the run summary counts: 3 of g-a (one pooled) and the truncated one.
    assert "training success (1 of 4 trainable" in html
    assert '<td>unknown_work</td><td class="n">2</td>' in html
    assert re.search(r'<div class="big">1</div>in the experience pool', html)
    assert re.search(r'<div class="big">1</div>pruned by retention', html)
    assert re.search(r'<div class="big" id="versions">2</div>latest policy version seen', html)
    assert 'id="no-summary"' in html and "still going, or it crashed" in html


def test_overview_shows_the_summary_when_the_run_wrote_one(view_run: Any) -> None:
    (view_run.run_dir / "summary.json").write_text(json.dumps({"versions_published": 7, "heldout": [{"v": 1}]}))
    with open_run(view_run.run_dir) as source, TestClient(create_app(source), base_url=LOCAL) as c:
        html = c.get("/").text
    assert "<tr><th>versions_published</th><td>7</td></tr>" in html
    assert 'id="no-summary"' not in html


def _utilization(html: str) -> dict[str, str]:
    return dict(re.findall(r'<td class="n util-(\w+)">([^<]+)</td>', html))


def test_a_finished_runs_utilization_is_the_summarys_over_the_same_window(view_run: Any, kit: Any) -> None:
    clock = kit.clock()
    kit.write_telemetry(view_run.run_dir, clock)
    telemetry = view_run.run_dir / "telemetry"
    # The RL window: the last 30 of the telemetry's 40 s, as dart run records it in the summary.
    start, end = clock.now - 30_000_000_000, clock.now
    (view_run.run_dir / "summary.json").write_text(json.dumps({"rl_start_unix_ns": start, "rl_end_unix_ns": end}))
    expected = utilization_by_kind(telemetry, start, end)
    with open_run(view_run.run_dir) as source, TestClient(create_app(source), base_url=LOCAL) as c:
        html = c.get("/").text
    assert _utilization(html) == {k: f"{100 * expected[k]:.1f}%" for k in ("env", "engine", "trainer")}
    assert "the RL window dart run recorded (as the summary)" in html and "(0.5 min)" in html
    assert 'id="live"' not in html and "fetch(location.href" not in html


def test_a_run_in_progress_updates_itself(view_run: Any, kit: Any) -> None:
    clock = kit.clock()
    start = clock.now
    kit.write_telemetry(view_run.run_dir, clock)  # written now: the services are writing
    (view_run.run_dir / RL_WINDOW_FILE).write_text(json.dumps({"rl_start_unix_ns": start}))
    with open_run(view_run.run_dir) as source, TestClient(create_app(source), base_url=LOCAL) as c:
        html = c.get("/").text
    assert 'id="live"' in html and "fetch(location.href" in html
    assert "the RL window dart run recorded, up to now" in html
    assert set(_utilization(html)) == {"env", "engine", "trainer"}
    assert "latest version published (5 published)" in html


def test_a_run_whose_services_went_quiet_without_a_summary_has_ended(view_run: Any, kit: Any) -> None:
    clock = kit.clock()
    start = clock.now
    kit.write_telemetry(view_run.run_dir, clock)
    (view_run.run_dir / RL_WINDOW_FILE).write_text(json.dumps({"rl_start_unix_ns": start}))
    quiet = time.time() - 2 * QUIET_S
    for path in (view_run.run_dir / "telemetry").rglob("*.jsonl"):
        os.utime(path, (quiet, quiet))
    with open_run(view_run.run_dir) as source, TestClient(create_app(source), base_url=LOCAL) as c:
        html = c.get("/").text
    assert 'id="live"' not in html and "up to the last record" in html
    window = observed_window(view_run.run_dir / "telemetry")
    assert window is not None
    expected = utilization_by_kind(view_run.run_dir / "telemetry", start, window[1])
    assert _utilization(html)["env"] == f"{100 * expected['env']:.1f}%"


def test_filters_narrow_the_list(client: TestClient) -> None:
    assert len(_ids(client.get("/trajectories").text)) == 7
    assert _ids(client.get("/trajectories?status=aborted").text) == ["traj-g-b-0"]
    assert _ids(client.get("/trajectories?success=yes").text) == ["traj-g-a-0", "traj-g-a-3"]
    assert _ids(client.get("/trajectories?task=sim/type/2").text) == ["traj-g-b-2"]
    assert _ids(client.get("/trajectories?min_version=2").text) == ["traj-g-b-2"]
    assert len(_ids(client.get("/trajectories?max_version=1").text)) == 6
    assert _ids(client.get("/trajectories?group=g-b&status=failed").text) == ["traj-g-b-1"]
    assert "0 matching trajectories" in client.get("/trajectories?group=nope").text
    # Each row links to its trajectory and its group.
    assert 'href="/groups/g-a"' in client.get("/trajectories?group=g-a").text


@pytest.mark.parametrize(
    ("query", "said"),
    [("status=done", "not a trajectory status"), ("success=maybe", "use yes or no"), ("min_version=x", "whole")],
)
def test_a_bad_filter_is_a_400_page_saying_why(client: TestClient, query: str, said: str) -> None:
    page = client.get(f"/trajectories?{query}")
    assert page.status_code == 400 and said in page.text


def test_pages_of_fifty_walk_forward_and_back(tmp_path: Path, kit: Any) -> None:
    run = kit.new_run(tmp_path / "run")
    for i in range(120):
        run.add(kit.make_traj(f"traj-{i:04d}", f"g-{i // 4}", i % 4, actions=()))
    with open_run(run.run_dir) as source, TestClient(create_app(source), base_url=LOCAL) as c:
        first = c.get("/trajectories?status=ok").text
        assert "120 matching trajectories" in first
        assert _ids(first) == [f"traj-{i:04d}" for i in range(50)]
        assert 'id="prev-page"' not in first
        next_url = re.search(r'id="next-page" rel="next" href="([^"]+)"', first)
        assert next_url is not None
        second = c.get(next_url.group(1).replace("&amp;", "&")).text
        assert _ids(second) == [f"traj-{i:04d}" for i in range(50, 100)]
        third = c.get(re.findall(r'id="next-page" rel="next" href="([^"]+)"', second)[0].replace("&amp;", "&")).text
        assert _ids(third) == [f"traj-{i:04d}" for i in range(100, 120)]
        assert 'id="next-page"' not in third
        back = c.get(re.findall(r'id="prev-page" rel="prev" href="([^"]+)"', third)[0].replace("&amp;", "&")).text
        assert _ids(back) == [f"traj-{i:04d}" for i in range(50, 100)]
        assert "status=ok" in re.findall(r'id="prev-page" rel="prev" href="([^"]+)"', back)[0]  # filters kept
    run.index.close()


def test_group_page_shows_each_rollout_with_the_data_managers_advantage(client: TestClient, kit: Any) -> None:
    page = client.get("/groups/g-a")
    assert page.status_code == 200
    shown = [float(a) for a in re.findall(r'<td class="n advantage">([-\d.]+)</td>', page.text)]
    assert shown == pytest.approx(group_advantages(list(kit.group_rewards)), abs=1e-3)
    assert page.text.count('class="rollout status-ok"') == 4
    assert "Rollouts never stored: 4." in page.text
    # Rollouts that are not trainable get no advantage; the others are normalized among themselves.
    other = client.get("/groups/g-b").text
    assert re.findall(r'<td class="n advantage">([^<]+)</td>', other) == ["-", "-", "0.000"]
    assert "no row for this group" in other


def test_trajectory_page_shows_every_step_with_its_action_drawn(client: TestClient, kit: Any) -> None:
    page = client.get("/trajectories/traj-g-a-0")
    assert page.status_code == 200
    html, screen, fed = page.text, kit.screen, kit.fed
    assert html.count('<section class="step"') == 6
    # The click: a circle on the pixel the env clicked, on the fed image and on the observation.
    step0 = html[html.index('id="step-0"') : html.index('id="step-1"')]
    assert f'viewBox="0 0 {fed[0]} {fed[1]}"' in step0 and f'viewBox="0 0 {screen[0]} {screen[1]}"' in step0
    circles = re.findall(r'<circle class="mark click" cx="([\d.]+)" cy="([\d.]+)"', step0)
    assert [(float(x), float(y)) for x, y in circles] == [
        pytest.approx((0.25 * fed[0], 0.75 * fed[1])),
        pytest.approx((0.25 * screen[0], 0.75 * screen[1])),
    ]
    step1 = html[html.index('id="step-1"') : html.index('id="step-2"')]
    assert f'x1="{0.1 * screen[0]}" y1="{0.2 * screen[1]}" x2="{0.6 * screen[0]}" y2="{0.8 * screen[1]}"' in step1
    assert "type: hello⏎</text>" in html and "keys: ctrl + c</text>" in html and "scroll down x3</text>" in html
    assert "finished: done</text>" in html
    # Log-prob heat map: one coloured cell per response token, its values on hover.
    assert html.count('class="tok"') == 6 * 3 and "log-prob -1.500, entropy 0.900 nats" in html
    assert "Thought: step 0." in html and "policy version 1" in html
    assert 'rel="next" href="/trajectories/traj-g-a-1"' in html and "<script>" in html


def test_tokens_are_shown_as_the_policys_tokenizer_writes_them(tmp_path: Path, kit: Any) -> None:
    from dart.policy.loading import load_tokenizer
    from dart.policy.tiny import write_tiny_checkpoint

    run = kit.new_run(tmp_path / "old-place")
    kit.fill_standard(run)
    run.index.close()
    write_tiny_checkpoint(run.run_dir / "model" / "sft")
    # The config as dart run writes it: absolute paths under the run directory, which then moved.
    old = run.run_dir.resolve()
    config = f"run: {{name: view-test, run_dir: '{old}'}}\nrollout: {{engine: {{model_path: '{old}/model/sft'}}}}\n"
    (run.run_dir / "config.yaml").write_text(config)
    moved = run.run_dir.rename(tmp_path / "new-place")
    expected = [load_tokenizer(moved / "model" / "sft").decode([i], skip_special_tokens=False) for i in (40, 41, 42)]
    with open_run(moved) as source, TestClient(create_app(source), base_url=LOCAL) as c:
        html = c.get("/trajectories/traj-g-a-0").text
    cells = re.findall(r'<span class="tok" [^>]*>([^<]*)</span>', html)
    assert cells[:3] == [escape(t.replace("\n", "⏎")) or "∅" for t in expected]
    assert "Token ids, not text" not in html


def test_tokens_are_ids_where_no_tokenizer_can_be_read(client: TestClient) -> None:
    html = client.get("/trajectories/traj-g-a-0").text
    assert re.findall(r'<span class="tok" [^>]*>([^<]*)</span>', html)[:3] == ["40", "41", "42"]
    assert "Token ids, not text: the run&#39;s config names no policy checkpoint." in html


def test_images_come_from_the_store_with_a_content_type(client: TestClient, view_run: Any, kit: Any) -> None:
    html = client.get("/trajectories/traj-g-a-1").text
    sources = re.findall(r'<img src="(/images/[^"]+)" width="(\d+)"', html)
    assert [int(w) for _, w in sources] == [kit.fed[0], kit.screen[0]]
    for src, _ in sources:
        image = client.get(src)
        assert image.status_code == 200 and image.headers["content-type"] == "image/png"
        assert image.content == view_run.path_of(src.removeprefix("/images/")).read_bytes()


def test_unknown_trajectory_group_and_path_are_404_pages(client: TestClient) -> None:
    for url, said in [
        ("/trajectories/traj-nope", "the index has no such trajectory"),
        ("/groups/g-nope", "the index has no such group"),
        ("/nowhere", "Not Found"),
        ("/images/trajectories/none.png", "it is not in the store"),
        ("/images/..%2Fconfig.yaml", "only the run's images"),
        ("/images/..%2Fconfig.png", "not a store key"),
    ]:
        page = client.get(url)
        assert page.status_code == 404, url
        assert said in page.text, (url, page.text)


def test_the_viewer_serves_only_images_and_only_to_its_own_host_names(client: TestClient, view_run: Any) -> None:
    """Weights and trajectory JSON stay in the store; a page whose name was pointed at 127.0.0.1 (DNS
    rebinding) is answered 400."""
    weights = view_run.path_of("weights/v1/model.safetensors")
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"tensor bytes")
    blob_key = view_run.stored["traj-g-a-2"].blob_key
    disguised = view_run.path_of("trajectories/disguised.png")
    disguised.write_bytes(view_run.path_of(blob_key).read_bytes())
    for url, said in [
        ("/images/weights/v1/model.safetensors", "only the run's images"),
        (f"/images/{blob_key}", "only the run's images"),
        ("/images/trajectories/disguised.png", "it is not an image"),
    ]:
        page = client.get(url)
        assert (page.status_code, said in page.text) == (404, True), (url, page.text)
    assert client.get("/").status_code == 200
    for host in ("evil.example", "127.0.0.1.evil.example", "attacker.localhost.example"):
        page = client.get("/", headers={"host": host})
        assert page.status_code == 400 and "does not serve host" in page.text, host
    assert client.get("/", headers={"host": "localhost:8765"}).status_code == 200
    assert client.get("/", headers={"host": "[::1]:8765"}).status_code == 200


def test_a_pruned_trajectory_says_retention_deleted_it(client: TestClient, view_run: Any) -> None:
    blob = view_run.path_of(view_run.stored["traj-g-a-2"].blob_key)
    blob.unlink()  # what retention does once it marked the trajectory pruned
    page = client.get("/trajectories/traj-g-a-2")
    assert page.status_code == 404
    assert "retention deleted this trajectory&#39;s objects" in page.text
    assert 'href="/groups/g-a"' in page.text  # the index row still leads on
    assert client.get("/").status_code == 200


def test_a_missing_blob_a_blob_that_does_not_parse_and_a_corrupted_one(client: TestClient, view_run: Any) -> None:
    view_run.path_of(view_run.stored["traj-g-a-1"].blob_key).unlink()
    missing = client.get("/trajectories/traj-g-a-1")
    assert missing.status_code == 404 and "it is not in the store" in missing.text
    # Stored as it is (its digest recorded): read back whole, it is no trajectory.
    view_run.blobs.store.put(view_run.stored["traj-g-b-2"].blob_key, b'{"kind": "trajectory", "steps": 3}')
    bad = client.get("/trajectories/traj-g-b-2")
    assert bad.status_code == 500 and "does not parse as a trajectory" in bad.text
    # Changed behind the store's back: its bytes no longer match their digest.
    view_run.path_of(view_run.stored["traj-g-b-1"].blob_key).write_bytes(b"{}")
    corrupted = client.get("/trajectories/traj-g-b-1")
    assert corrupted.status_code == 500 and "is corrupted" in corrupted.text
    assert client.get("/trajectories/traj-g-a-0").status_code == 200


def test_a_missing_image_is_named_on_the_page(client: TestClient, view_run: Any) -> None:
    html = client.get("/trajectories/traj-g-a-3").text
    src = re.findall(r'<img src="/images/([^"]+)"', html)[1]
    view_run.path_of(src).unlink()
    page = client.get("/trajectories/traj-g-a-3")
    assert page.status_code == 200
    assert f"Image not shown: {src} is not in the store" in page.text
    assert client.get(f"/images/{src}").status_code == 404


def test_a_deployment_config_reads_its_database_and_store(tmp_path: Path, postgres_url: str, kit: Any) -> None:
    run = kit.new_run(tmp_path / "run", postgres_url)
    kit.fill_standard(run)
    config = tmp_path / "run.yaml"
    store = (run.run_dir / "artifacts").as_uri()
    # As a deployment's services read it: NATS credentials from their environment, which the viewer lacks.
    bus = "bus: {url: 'nats://nats:4222', password_env: DART_NATS_PASSWORD}\n"
    config.write_text(
        f"run: {{name: dart}}\n{bus}store: {{uri: '{store}'}}\ndata: {{database_url: '{postgres_url}'}}\n"
    )
    with open_run(config=config) as source, TestClient(create_app(source), base_url=LOCAL) as c:
        assert "training success (1 of 4 trainable" in c.get("/").text
        assert "a deployment&#39;s services write no summary.json" in c.get("/").text
        assert "no telemetry directory: start dart view with --telemetry DIR" in c.get("/").text
        assert _ids(c.get("/trajectories?success=yes").text) == ["traj-g-a-0", "traj-g-a-3"]
        assert c.get("/trajectories/traj-g-a-0").text.count('<section class="step"') == 6
        assert 'id="live"' in c.get("/").text  # a deployment goes on: its index keeps changing
    # Its services' telemetry, where they write it to a directory this host reads.
    kit.write_telemetry(tmp_path / "shared", kit.clock())
    with open_run(config=config, telemetry=tmp_path / "shared" / "telemetry") as source:
        with TestClient(create_app(source), base_url=LOCAL) as c:
            html = c.get("/").text
    assert set(_utilization(html)) == {"env", "engine", "trainer"} and "the span the telemetry covers" in html
    run.index.close()


def test_a_rollouts_branches_show_as_a_tree_and_a_branch_links_its_parent(tmp_path: Path, kit: Any) -> None:
    run = kit.new_run(tmp_path / "run")
    clicks = (m.Click(x=0.25, y=0.75),) * 4
    parent = kit.make_traj("root", "g-t", 0, actions=clicks)
    run.add(parent)
    for tid, step, reward in (("kid-a", 1, 1.0), ("kid-b", 1, 0.0), ("kid-c", 3, 1.0)):
        base = kit.make_traj(tid, "g-t", 0, reward=reward, actions=clicks)
        steps = [s.model_copy(update={"index": i}) for i, s in enumerate(base.steps) if i >= step]
        run.add(
            m.Trajectory.model_validate(
                {
                    **base.model_dump(),
                    "steps": [s.model_dump() for s in steps],
                    "branch": {"parent_trajectory_id": "root", "step_index": step},
                }
            )
        )
    with open_run(run.run_dir) as source, TestClient(create_app(source), base_url=LOCAL) as c:
        root = c.get("/trajectories/root").text
        tree = root[root.index('id="branches"') : root.index("</section>", root.index('id="branches"'))]
        # Two branch points, in step order, each with its branches.
        assert re.findall(r'href="#step-(\d)"', tree) == ["1", "3"]
        assert re.findall(r">(kid-\w)</code></a>: reward ([\d.]+)", tree) == [
            ("kid-a", "1.000"),
            ("kid-b", "0.000"),
            ("kid-c", "1.000"),
        ]
        kid = c.get("/trajectories/kid-c").text
        assert 'id="parent"' in kid and 'href="/trajectories/root"' in kid and "forked at step 3" in kid
        assert kid.count('<section class="step"') == 1 and 'id="step-3"' in kid and 'id="branches"' not in kid
        group = c.get("/groups/g-t").text
        assert group.count("branch of rollout 0 at step") == 3
        assert group.count("per step, against its siblings") == 3
    run.index.close()
