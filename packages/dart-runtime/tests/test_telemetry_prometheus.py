"""Each service serves its metrics for Prometheus: tracked events as gauges, busy time as a counter."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import pytest

from dart.runtime.telemetry import Telemetry, TelemetryConfig, setup_telemetry
from dart.runtime.telemetry.event_metrics import gauge_name

pytestmark = pytest.mark.integration


def _scrape(telemetry: Telemetry) -> str:
    address = telemetry.prometheus_address
    assert address is not None
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def _value(text: str, metric: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(metric + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {metric} with {labels} in:\n{text[:3000]}")


async def test_tracked_events_and_busy_time_are_scraped(tmp_path: Path) -> None:
    config = TelemetryConfig(run_dir=tmp_path, prometheus_port=0)
    # Starting and stopping the exporters' HTTP servers is blocking work: off the event loop (on a busy
    # machine it takes over a second).
    train = await asyncio.to_thread(setup_telemetry, "dart-train", version="0", run_id="r1", config=config)
    data = await asyncio.to_thread(setup_telemetry, "dart-data", version="0", run_id="r1", config=config)
    try:
        train.event("trainer.step", step=3, loss=0.25, duration_s=1.5, batch_id="b")
        train.event("trajectory.done", reward=1.0)  # not a tracked event: no gauge
        data.event("data.stats", stored=12)
        tracker = train.busy_tracker("trainer", "trainer-0")
        async with tracker.busy("train_step"):
            await asyncio.sleep(0.05)
        # The scrape is blocking I/O, answered by a thread of this process: off the event loop.
        text = await asyncio.to_thread(_scrape, train)
        assert _value(text, "dart_trainer_step_loss", service_name="dart-train", dart_run_id="r1") == 0.25
        assert _value(text, "dart_trainer_step_duration_s_seconds", service_name="dart-train") == 1.5
        assert _value(text, "dart_resource_busy_time_seconds_total", resource_kind="trainer") > 0.0
        assert "trajectory_done" not in text
        assert "dart_data_stats_stored" not in text, "one service's endpoint shows another's series"
        assert (
            _value(await asyncio.to_thread(_scrape, data), "dart_data_stats_stored", service_name="dart-data") == 12.0
        )
        assert train.prometheus_address != data.prometheus_address
    finally:
        await asyncio.to_thread(train.shutdown)
        await asyncio.to_thread(data.shutdown)
    assert re.fullmatch(r"dart\.trainer\.step\.loss", gauge_name("trainer.step", "loss"))


async def test_engine_updates_are_one_series_per_engine(tmp_path: Path) -> None:
    # Per-worker weight sync: each engine's latest update is its own series, labelled by engine_id.
    config = TelemetryConfig(run_dir=tmp_path, prometheus_port=0)
    rollout = await asyncio.to_thread(setup_telemetry, "dart-rollout", version="0", run_id="r1", config=config)
    try:
        rollout.event("engine.update.end", engine_id="engine-0", version=3, ts=20.0, started_at=19.5, ok=True)
        rollout.event("engine.update.end", engine_id="engine-1", version=2, ts=21.0, started_at=20.0, ok=True)
        text = await asyncio.to_thread(_scrape, rollout)
        assert _value(text, "dart_engine_update_end_version", engine_id="engine-0") == 3.0
        assert _value(text, "dart_engine_update_end_version", engine_id="engine-1") == 2.0
        assert _value(text, "dart_engine_update_end_started_at", engine_id="engine-1") == 20.0
    finally:
        await asyncio.to_thread(rollout.shutdown)


def test_no_endpoint_unless_configured(tmp_path: Path) -> None:
    telemetry = setup_telemetry("dart-env", version="0", run_id="r1", config=TelemetryConfig(run_dir=tmp_path))
    try:
        assert telemetry.prometheus_address is None
    finally:
        telemetry.shutdown()
