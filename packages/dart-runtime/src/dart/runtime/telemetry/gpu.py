"""GPU utilization sampling through NVML, into telemetry (``gpu.sample`` events).

Lifecycle of a :class:`GpuSampler`: ``created`` -> :meth:`~GpuSampler.start`: NVML is initialized;
when that fails (no ``pynvml``, no driver, no device) the sampler is ``unavailable``: it writes one
``gpu.unavailable`` event with the reason and never samples (no made-up zeros) -> otherwise
``sampling``: every ``interval_s`` one ``gpu.sample`` event per device (``gpu`` index,
``util_pct`` = NVML's percent of the last sample period a kernel ran, ``mem_used_bytes``) ->
:meth:`~GpuSampler.stop`: the task ends and NVML is shut down. A device that errors mid-run is
logged once and skipped from then on.

``pynvml`` (PyPI ``nvidia-ml-py``) is imported lazily: dart-runtime does not depend on it; the
services that own GPUs (dart-rollout, dart-train) do.

Example:
    >>> sampler = GpuSampler(telemetry, interval_s=1.0)     # doctest: +SKIP
    >>> await sampler.start()                                 # doctest: +SKIP
    >>> ...
    >>> await sampler.stop()                                  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dart.runtime.telemetry.jsonl import read_jsonl

if TYPE_CHECKING:
    from dart.runtime.telemetry.setup import Telemetry

log = logging.getLogger("dart.runtime.telemetry.gpu")

SAMPLE_EVENT = "gpu.sample"
UNAVAILABLE_EVENT = "gpu.unavailable"


def load_nvml() -> Any:
    """The ``pynvml`` module, initialized.

    Raises:
        RuntimeError: pynvml is not installed, or NVML did not initialize (no driver), with the reason.
    """
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError as exc:
        raise RuntimeError(f"pynvml is not installed ({exc})") from exc
    try:
        nvml.nvmlInit()
    except Exception as exc:  # pynvml raises NVMLError subclasses, or OSError from ctypes
        raise RuntimeError(f"NVML did not initialize: {exc}") from exc
    return nvml


class GpuSampler:
    """Samples every visible GPU's utilization and memory into telemetry; see the module docstring.

    Args:
        telemetry: Where ``gpu.*`` events go.
        interval_s: Seconds between samples.
        source: Which service samples (an event attribute, e.g. ``rollout``).
        nvml: An already imported NVML binding (``pynvml``-compatible); None imports ``pynvml``.
            :meth:`start` calls its ``nvmlInit`` either way.
    """

    def __init__(self, telemetry: Telemetry, *, interval_s: float = 1.0, source: str = "", nvml: Any = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._telemetry = telemetry
        self._interval_s = interval_s
        self._source = source
        self._nvml_given = nvml
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self._task: asyncio.Task[None] | None = None
        self.unavailable_reason: str | None = None
        """Why nothing is sampled (after :meth:`start`), or None while sampling."""
        self.samples = 0
        """``gpu.sample`` events written."""

    @property
    def available(self) -> bool:
        """Whether at least one GPU is being sampled."""
        return bool(self._handles)

    async def start(self) -> None:
        """Initialize NVML and start sampling, or record once why there is nothing to sample."""
        try:
            self._nvml, self._handles = await asyncio.to_thread(self._open)
        except RuntimeError as exc:
            self.unavailable_reason = str(exc)
            log.info("no GPU sampling: %s", exc)
            self._telemetry.event(UNAVAILABLE_EVENT, source=self._source, reason=str(exc))
            return
        self._task = asyncio.create_task(self._loop(), name="gpu-sampler")

    async def stop(self) -> None:
        """Stop sampling and shut NVML down. Idempotent."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None
            self._handles = {}

    def _open(self) -> tuple[Any, dict[int, Any]]:
        nvml = self._nvml_given
        if nvml is None:
            nvml = load_nvml()
        else:
            try:
                nvml.nvmlInit()
            except Exception as exc:
                raise RuntimeError(f"NVML did not initialize: {exc}") from exc
        try:
            count = int(nvml.nvmlDeviceGetCount())
            handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)}
        except Exception as exc:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            raise RuntimeError(f"NVML could not list devices: {exc}") from exc
        if not handles:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            raise RuntimeError("NVML found no GPU")
        return nvml, handles

    def sample_once(self) -> list[dict[str, Any]]:
        """Read every device now; returns the samples written (blocking NVML calls, well under 1 ms each)."""
        out: list[dict[str, Any]] = []
        for index, handle in list(self._handles.items()):
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:
                log.warning("GPU %d stopped answering NVML (%s); no longer sampled", index, exc)
                del self._handles[index]
                continue
            sample = {"gpu": index, "util_pct": float(util.gpu), "mem_used_bytes": int(mem.used)}
            self._telemetry.event(SAMPLE_EVENT, source=self._source, **sample)
            self.samples += 1
            out.append(sample)
        return out

    async def _loop(self) -> None:
        while self._handles:
            await asyncio.to_thread(self.sample_once)
            await asyncio.sleep(self._interval_s)


@dataclass(frozen=True)
class GpuSummary:
    """GPU samples of a window, per sampling service.

    Attributes:
        samples: Number of ``gpu.sample`` events in the window.
        mean_util_pct: Mean utilization over them, percent; None without samples ("no GPU").
        max_mem_used_bytes: Largest memory use seen, bytes; None without samples.
        unavailable: Reasons services gave for not sampling.
    """

    samples: int
    mean_util_pct: float | None
    max_mem_used_bytes: int | None
    unavailable: tuple[str, ...] = ()


def gpu_summary(
    source: str | Path | Iterable[Mapping[str, Any]],
    *,
    start_ns: int | None = None,
    end_ns: int | None = None,
    service: str | None = None,
) -> GpuSummary:
    """Summarize ``gpu.*`` events of JSONL telemetry (a file, a directory, or already read records).

    Args:
        source: A telemetry JSONL file or directory, or event records (``name``, ``ts_unix_ns``, ``attributes``).
        start_ns: Only samples at or after this Unix ns.
        end_ns: Only samples at or before this Unix ns.
        service: Only samples whose ``source`` attribute is this.
    """
    records = read_jsonl(source, types={"event"}) if isinstance(source, str | Path) else source
    utils: list[float] = []
    mem: list[int] = []
    reasons: list[str] = []
    for rec in records:
        name = rec.get("name")
        attrs = rec.get("attributes", {})
        if service is not None and attrs.get("source") != service:
            continue
        if name == UNAVAILABLE_EVENT:
            reasons.append(str(attrs.get("reason", "")))
            continue
        if name != SAMPLE_EVENT:
            continue
        ts = int(rec["ts_unix_ns"])
        if (start_ns is not None and ts < start_ns) or (end_ns is not None and ts > end_ns):
            continue
        utils.append(float(attrs["util_pct"]))
        mem.append(int(attrs["mem_used_bytes"]))
    return GpuSummary(
        samples=len(utils),
        mean_util_pct=sum(utils) / len(utils) if utils else None,
        max_mem_used_bytes=max(mem) if mem else None,
        unavailable=tuple(sorted(set(reasons))),
    )
