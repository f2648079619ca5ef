"""``dart report``: a synthetic run directory written with the real telemetry writers and schema."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from sqlalchemy import create_engine, insert
from typer.testing import CliRunner

from dart.cli import report
from dart.cli.report.load import load_run
from dart.cli.report.plots import Plot, kind_timeline, plot_utilization, rolling_rate
from dart.data.schema import migrate, trajectories
from dart.protocol.telemetry import BusyInterval, BusyTracker, Telemetry, TelemetryConfig, setup_telemetry

pytestmark = pytest.mark.unit

SECTIONS = (
    "Summary",
    "Configuration",
    "Success rate",
    "Held-out validation",
    "Utilization",
    "Staleness",
    "Training",
    "Weight updates",
)


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


class FakeClock:
    """Unix ns that only moves when told to, starting now (so it brackets the real events)."""

    def __init__(self) -> None:
        self.now = time.time_ns()

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


def _write_telemetry(run_dir: Path, clock: FakeClock) -> None:
    def tel(service: str) -> Telemetry:
        config = TelemetryConfig(jsonl_path=run_dir / "telemetry" / f"{service}.jsonl")
        return setup_telemetry(f"dart-{service}", version="0", run_id="r1", config=config)

    env, rollout, data, train = tel("env"), tel("rollout"), tel("data"), tel("train")
    validation = tel("validation")
    # Held-out evaluations at versions 0 and 5, as dart run's validator writes them.
    validation.event("validation.heldout", version=0, success=0.25, ci95_low=0.13, ci95_high=0.42, n=32, errors=0)
    validation.event("validation.heldout", version=5, success=0.5, ci95_low=0.34, ci95_high=0.66, n=32, errors=0)
    envs = [BusyTracker("env", f"env-{i}", env, clock=clock) for i in range(3)]
    engine = BusyTracker("engine", "engine-0", rollout, clock=clock)
    trainer = BusyTracker("trainer", "trainer", train, clock=clock)
    t0 = clock.now / 1e9
    for step in range(1, 11):
        tokens = [e.begin("step") for e in envs[: 1 + step % 3]]
        gen = engine.begin("generate")
        clock.advance(2.0)
        for e, tok in zip(envs, tokens, strict=False):
            e.end(tok)
        engine.end(gen)
        with trainer.busy("train_step"):
            clock.advance(1.0)
        clock.advance(1.0)
        data.event("data.batch", batch_id=f"b{step}", samples=8, groups=2, staleness=step % 3)
        train.event(
            "trainer.step",
            step=step,
            loss=1.0 / step,
            clip_fraction=0.1,
            tis_weight_mean=0.95,
            tis_truncated_fraction=0.01,
            grad_norm=2.0,
            rollout_mismatch=0.02,
            entropy=1.5 - step / 10,
            max_policy_lag=step % 2,
        )
        if step % 2 == 0:
            version = step // 2
            train.event(
                "trainer.published",
                version=version,
                uri=f"file:///w/{version}",
                sha256="0",
                step=step,
                bytes=59_792,
                kind="lora adapter",
                adapter_rank=8,
            )
            at = clock.now / 1e9
            for engine_id in ("engine-0", "engine-1"):
                rollout.event("engine.update.start", engine_id=engine_id, version=version, ts=at)
                rollout.event(
                    "engine.update.end",
                    engine_id=engine_id,
                    version=version,
                    ts=at + 0.5,
                    started_at=at,
                    ok=engine_id == "engine-0" or version < 5,
                    error="",
                )
    # An update the run ended in the middle of: drawn up to the end of the run.
    rollout.event("engine.update.start", engine_id="engine-1", version=6, ts=clock.now / 1e9 - 4.0)
    data.event("data.stats", received=42, stored=40, duplicates=2, drops={"stale": 3}, outstanding=0)
    assert clock.now / 1e9 - t0 == pytest.approx(40.0)
    for t in (env, rollout, data, train):
        t.shutdown()


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
def run_dir(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "run-1"
    root.mkdir()
    (root / "config.yaml").write_text("run_id: r1\ntrain:\n  lr: 1.0e-06\n  publish_every: 2\n")
    (root / "summary.json").write_text(json.dumps({"versions_published": 5, "ok": True}))
    clock = FakeClock()
    t0 = clock.now / 1e9
    _write_telemetry(root, clock)
    _write_index(root, t0)
    yield root


def test_full_report(run_dir: Path) -> None:
    code, out, err = invoke(str(run_dir))
    assert code == 0, err
    target = run_dir / "report.html"
    assert out.splitlines()[0] == str(target)
    assert json.loads(out.strip().splitlines()[-1]) == {"report": str(target), "plots": 7}
    page = target.read_text()
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page
    assert len(re.findall(r'<img alt="[^"]*" src="data:image/png;base64,', page)) == 7
    assert "<th>held-out success (greedy)</th><td>v0 25.0% [13%, 42%] -&gt; v5 50.0% [34%, 66%] (n=32)</td>" in page
    assert 'class="note"' not in page  # every piece is present
    assert "publish_every: 2" in page and "versions_published" in page
    assert "<th>versions published</th><td>5 (latest v5)</td>" in page
    assert "<th>a version is</th><td>lora adapter (rank 8); the last is 59,792 bytes</td>" in page
    assert "<th>trajectories produced</th><td>40</td>" in page
    assert "<th>trajectories lost (aborted/failed)</th><td>8</td>" in page
    assert "stale: 3" in page
    # Trainable (ok/truncated, not pooled) successes: none in the first quarter, all in the last.
    assert "<th>success, first quarter</th><td>0.0%</td>" in page
    assert "<th>success, last quarter</th><td>100.0%</td>" in page
    assert re.search(r"<th>env utilization</th><td>\d+\.\d% \(mean of 3\)</td>", page)


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
    (root / "config.yaml").write_text("run_id: crashed\n")
    out_file = tmp_path / "elsewhere" / "r.html"
    code, out, err = invoke(str(root), "--out", str(out_file))
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"report": str(out_file), "plots": 0}
    page = out_file.read_text()
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page
    assert "No trainer.step events" in page and "no data.sqlite3" in page and "no summary.json" in page


def test_unreadable_database_is_noted(tmp_path: Path) -> None:
    root = tmp_path / "r"
    root.mkdir()
    (root / "data.sqlite3").write_bytes(b"not a database at all" * 100)
    data = load_run(root)
    assert data.trajectories == [] and any("data.sqlite3 could not be read" in p for p in data.problems)


def test_not_a_run_dir_exits_2(tmp_path: Path) -> None:
    code, _, err = invoke(str(tmp_path))
    assert code == 2 and "holds none of" in err
    code, _, err = invoke(str(tmp_path / "absent"))
    assert code == 2 and "not a directory" in err


def test_rolling_rate() -> None:
    assert rolling_rate([True, False, True, True], 2) == [1.0, 0.5, 0.5, 1.0]
    assert rolling_rate([], 3) == []


def test_kind_timeline_averages_instances() -> None:
    items = [BusyInterval("env", "a", "step", 0, 10), BusyInterval("env", "b", "step", 5, 10)]
    assert kind_timeline(items, 0, 10, 5) == [(0, 0.5), (5, 1.0)]


def test_utilization_plot_is_a_png(run_dir: Path) -> None:
    plot = plot_utilization(load_run(run_dir))
    assert isinstance(plot, Plot) and plot.png.startswith(b"\x89PNG\r\n\x1a\n")
