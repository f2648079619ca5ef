"""`dart run`'s summary carries the idle breakdown and the GPU figure, computed from the run's telemetry."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dart.cli.stack.summary import build_summary, resource_counts
from dart.runtime.telemetry import BusyTracker, TelemetryConfig, setup_telemetry

pytestmark = pytest.mark.unit

S = 1_000_000_000
T0 = 1_700_000_000 * S


def test_summary_has_idle_breakdown_and_no_gpu(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump({"env": {"instances": 2}, "rollout": {"num_engines": 1, "runners": 2}})
    )
    assert resource_counts(tmp_path) == {"env": 2, "engine": 1, "runner": 2, "trainer": 1}
    ticks = iter(T0 + i * S for i in range(100))
    tel = setup_telemetry(
        "dart-rollout",
        version="0",
        run_id="r",
        config=TelemetryConfig(jsonl_path=tmp_path / "telemetry" / "rollout.jsonl", metric_export_interval_s=60),
    )
    try:
        env = BusyTracker("env", "env-0", tel, clock=lambda: next(ticks))  # created at t=0
        runner = BusyTracker("runner", "runner-0", tel, clock=lambda: next(ticks))  # t=1
        lease = runner.begin("leased")  # t=2
        with env.busy("step"):  # 3..4
            pass
        with runner.busy("generate"):  # 5..6
            pass
        runner.end(lease)  # t=7
        tel.event("gpu.unavailable", source="rollout", reason="NVML did not initialize")
    finally:
        tel.shutdown()
    summary = build_summary(tmp_path, produced=0, versions=0, rl_start_ns=T0, rl_end_ns=T0 + 10 * S, extra={})
    idle = summary["idle_breakdown"]
    assert idle["counts"] == {"env": 2, "engine": 1, "runner": 2, "trainer": 1}
    # env capacity 2 x 10 s: busy 1, waiting for action 1, other leased idle 3, the rest without a lease
    assert idle["env"] == {
        "busy": 0.05,
        "waiting_for_action": 0.05,
        "waiting_for_weights": 0.0,
        "leased_overhead": 0.15,
        "no_lease": 0.75,
    }
    assert idle["engine"]["waiting_for_requests"] == 1.0
    assert idle["trainer"]["waiting_for_batches"] == 1.0
    assert summary["gpu"] == {"rollout": "no GPU", "train": "no GPU"}


def test_summary_of_an_empty_window_has_no_breakdown(tmp_path: Path) -> None:
    (tmp_path / "telemetry").mkdir()
    summary = build_summary(tmp_path, produced=0, versions=0, rl_start_ns=T0, rl_end_ns=T0, extra={})
    assert summary["idle_breakdown"] is None
    assert summary["gpu"] == {"rollout": "no GPU", "train": "no GPU"}


def test_summary_reports_rejections_and_does_not_count_them_lost(tmp_path: Path) -> None:
    from dart.data.index import TrajectoryIndex

    index = TrajectoryIndex(f"sqlite:///{tmp_path / 'data.sqlite3'}")
    index.migrate()
    for seq, reason in enumerate(["unknown_work", "duplicate_work", "unknown_work"], start=1):
        index.record_rejection("traj", seq, reason, "test")
    index.close()
    (tmp_path / "telemetry").mkdir()
    summary = build_summary(tmp_path, produced=3, versions=0, rl_start_ns=T0, rl_end_ns=T0, extra={})
    assert summary["rejected"] == {"total": 3, "by_reason": {"duplicate_work": 1, "unknown_work": 2}}
    assert summary["trajectories_lost"] == 0
