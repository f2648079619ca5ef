"""Staleness in `dart run`: the summary's policy lag of what was trained on and what the bounds held back,
and the slow-trainer example that shows them at work."""

from __future__ import annotations

from pathlib import Path

import pytest

from dart.cli.stack.config import load_run_config
from dart.cli.stack.summary import build_summary, staleness_figures
from dart.runtime.telemetry import TelemetryConfig, setup_telemetry

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def _events(path: Path, service: str, events: list[tuple[str, dict[str, int]]]) -> None:
    tel = setup_telemetry(
        service, version="0", run_id="r", config=TelemetryConfig(jsonl_path=path, metric_export_interval_s=60)
    )
    try:
        for name, attrs in events:
            tel.event(name, **attrs)
    finally:
        tel.shutdown()


def test_trained_lag_excludes_pool_replays_and_drops_are_counted(tmp_path: Path) -> None:
    tel = tmp_path / "telemetry"
    step = {"max_policy_lag": 1, "pool_samples": 0, "pool_max_policy_lag": 0}
    _events(
        tel / "train.jsonl",
        "dart-train",
        [
            ("trainer.step", step),
            ("trainer.stale_dropped", {"samples": 3, "kept": 5}),
            ("trainer.step", {**step, "max_policy_lag": 2, "pool_samples": 1, "pool_max_policy_lag": 9}),
            ("trainer.stale_dropped", {"samples": 4, "kept": 0}),
        ],
    )
    _events(tel / "data.jsonl", "dart-data", [("data.emission_throttled", {"queued_batches": 3, "limit": 2})] * 2)
    assert staleness_figures(tel) == {
        "max_trained_policy_lag": 2,
        "max_trained_pool_policy_lag": 9,  # old on purpose: reported apart, never bounded
        "stale_samples_dropped": 7,
        "stale_batches_dropped": 1,
        "emission_throttles": 2,
    }
    summary = build_summary(tmp_path, produced=0, versions=0, rl_start_ns=0, rl_end_ns=0, extra={})
    assert summary["max_trained_policy_lag"] == 2 and summary["stale_samples_dropped"] == 7


def test_no_training_no_lag(tmp_path: Path) -> None:
    figures = staleness_figures(tmp_path / "telemetry")
    assert figures["max_trained_policy_lag"] is None and figures["max_trained_pool_policy_lag"] is None
    assert figures["stale_samples_dropped"] == 0 and figures["emission_throttles"] == 0


def test_slow_trainer_example_is_smoke_with_a_slow_trainer_and_tight_bounds() -> None:
    slow = load_run_config(ROOT / "examples" / "smoke-slow-trainer.yaml")
    smoke = load_run_config(ROOT / "examples" / "smoke.yaml")
    assert slow.train.debug_step_delay_s > 0 and smoke.train.debug_step_delay_s == 0
    assert slow.data.grouping.max_staleness is not None and slow.data.emission.decoupled.max_queued_batches == 1
    assert slow.data.grouping.max_staleness < (smoke.data.grouping.max_staleness or 0)
    assert slow.suite == smoke.suite and slow.data.batching == smoke.data.batching
