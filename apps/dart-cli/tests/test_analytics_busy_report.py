"""Per-resource utilization from JSONL telemetry (``dart.cli.analytics.busy_report``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dart.cli.analytics import resource_utilization
from dart.runtime.telemetry import TelemetryConfig, setup_telemetry

pytestmark = pytest.mark.unit

S = 1_000_000_000
T0 = 1_700_000_000 * S


class FakeClock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> int:
        return self.t


def test_utilization_per_resource_and_activity(tmp_path: Path) -> None:
    clock = FakeClock()
    telemetry = setup_telemetry(
        "dart-env", version="0", run_id="r", config=TelemetryConfig(run_dir=tmp_path, metric_export_interval_s=60)
    )
    envs = [telemetry.busy_tracker("env", f"env-{i}", clock=clock) for i in range(2)]
    for start, end, env, activity in [(0, 4, 0, "step"), (5, 7, 0, "step"), (2, 10, 1, "step"), (8, 9, 0, "reset")]:
        clock.t = T0 + start * S
        token = envs[env].begin(activity)
        clock.t = T0 + end * S
        envs[env].end(token)
    telemetry.shutdown()
    stats = resource_utilization(telemetry.jsonl_path, start_ns=T0, end_ns=T0 + 10 * S)
    assert stats[("env", "env-0")].busy_s == 7.0
    assert stats[("env", "env-0")].utilization == 0.7
    assert dict(stats[("env", "env-0")].by_activity) == {"reset": 1.0, "step": 6.0}
    assert stats[("env", "env-1")].utilization == 0.8
    assert resource_utilization(telemetry.jsonl_path, resource_kind="engine") == {}


def test_default_window_spans_the_service_lifetime(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(
            [
                f'{{"type": "event", "name": "telemetry.start", "ts_unix_ns": {T0}}}',
                f'{{"type": "busy", "resource_kind": "env", "resource_id": "a", "activity": "step", '
                f'"start_unix_ns": {T0 + 2 * S}, "end_unix_ns": {T0 + 3 * S}}}',
                f'{{"type": "event", "name": "telemetry.stop", "ts_unix_ns": {T0 + 4 * S}}}',
                f'{{"type": "event", "name": "other", "ts_unix_ns": {T0 + 100 * S}}}',
            ]
        )
        + "\n"
    )
    stats = resource_utilization(path)[("env", "a")]
    assert (stats.start_ns, stats.end_ns, stats.wall_s, stats.utilization) == (T0, T0 + 4 * S, 4.0, 0.25)
    assert (
        resource_utilization(tmp_path / "t.jsonl", start_ns=T0 + 2 * S, end_ns=T0 + 3 * S)[("env", "a")].utilization
        == 1.0
    )
