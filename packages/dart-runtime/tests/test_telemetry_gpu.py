"""GPU sampling through NVML: the no-GPU path for real, NVML failures, and what samples look like.

The real ``pynvml`` is used where it matters (this machine has no NVIDIA driver, so NVML fails to
initialize for real); the sampling loop itself is driven by a small stand-in for the NVML binding,
since a test cannot make a GPU appear or fail on demand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dart.runtime.telemetry import GpuSampler, Telemetry, TelemetryConfig, gpu_summary, read_jsonl, setup_telemetry
from dart.runtime.telemetry.gpu import load_nvml

pytestmark = pytest.mark.unit


@pytest.fixture
def telemetry(tmp_path: Path) -> Iterator[Telemetry]:
    tel = setup_telemetry(
        "dart-rollout", version="0", run_id="r", config=TelemetryConfig(run_dir=tmp_path, metric_export_interval_s=60)
    )
    yield tel
    tel.shutdown()


def events(tmp_path: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(tmp_path, types={"event"}) if str(r["name"]).startswith("gpu.")]


class StubNvml:
    """The slice of the pynvml API the sampler uses, for ``devices`` GPUs."""

    def __init__(self, devices: int = 2, *, init_error: Exception | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.broken: set[int] = set()
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.devices

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        if h in self.broken:
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(gpu=40 + 10 * h, memory=5)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=(h + 1) * 1000, total=10_000, free=10_000 - (h + 1) * 1000)


def _has_gpu() -> bool:
    try:
        nvml = load_nvml()
    except RuntimeError:
        return False
    try:
        return int(nvml.nvmlDeviceGetCount()) > 0
    finally:
        nvml.nvmlShutdown()


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU; the no-GPU path is not reachable")
async def test_no_gpu_records_nothing_but_the_reason(telemetry: Telemetry, tmp_path: Path) -> None:
    sampler = GpuSampler(telemetry, interval_s=0.01, source="rollout")
    await sampler.start()
    assert not sampler.available
    assert sampler.unavailable_reason
    await sampler.stop()
    telemetry.shutdown()
    recorded = events(tmp_path)
    assert [r["name"] for r in recorded] == ["gpu.unavailable"]
    assert recorded[0]["attributes"]["source"] == "rollout"
    summary = gpu_summary(tmp_path)
    assert summary.samples == 0 and summary.mean_util_pct is None  # "no GPU", not 0 %
    assert summary.unavailable == (sampler.unavailable_reason,)


@pytest.mark.parametrize(
    ("stub", "reason"),
    [
        (StubNvml(init_error=OSError("libnvidia-ml.so.1: cannot open shared object file")), "did not initialize"),
        (StubNvml(devices=0), "found no GPU"),
    ],
)
async def test_nvml_failing_or_no_device_is_unavailable(
    telemetry: Telemetry, tmp_path: Path, stub: StubNvml, reason: str
) -> None:
    sampler = GpuSampler(telemetry, interval_s=0.01, nvml=stub)
    await sampler.start()
    assert not sampler.available
    assert reason in (sampler.unavailable_reason or "")
    await sampler.stop()
    assert [r["name"] for r in events(tmp_path)] == ["gpu.unavailable"]


async def test_samples_every_device_and_drops_one_that_fails(telemetry: Telemetry, tmp_path: Path) -> None:
    stub = StubNvml(devices=2)
    sampler = GpuSampler(telemetry, interval_s=0.01, source="train", nvml=stub)
    await sampler.start()
    assert sampler.available
    for _ in range(500):  # the loop samples in the background; wait for two rounds
        if sampler.samples >= 4:
            break
        await asyncio.sleep(0.01)
    stub.broken.add(1)
    assert sampler.sample_once() == [{"gpu": 0, "util_pct": 40.0, "mem_used_bytes": 1000}]
    assert sampler.sample_once() == [{"gpu": 0, "util_pct": 40.0, "mem_used_bytes": 1000}]
    await sampler.stop()
    await sampler.stop()  # idempotent
    assert stub.shutdowns == 1
    recorded = [r["attributes"] for r in events(tmp_path)]
    assert {(a["gpu"], a["util_pct"], a["mem_used_bytes"]) for a in recorded} == {(0, 40.0, 1000), (1, 50.0, 2000)}
    assert all(a["source"] == "train" for a in recorded)
    summary = gpu_summary(tmp_path, service="train")
    assert summary.samples == len(recorded)
    assert summary.mean_util_pct is not None and 40.0 <= summary.mean_util_pct <= 50.0
    assert summary.max_mem_used_bytes == 2000
    assert gpu_summary(tmp_path, service="rollout").samples == 0


def test_interval_must_be_positive(telemetry: Telemetry) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        GpuSampler(telemetry, interval_s=0)
