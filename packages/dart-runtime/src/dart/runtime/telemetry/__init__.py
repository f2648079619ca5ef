"""Telemetry for DART services: OpenTelemetry traces and metrics, a JSONL sink, busy accounting.

Example:
    >>> from dart.runtime.telemetry import TelemetryConfig, setup_telemetry
    >>> tel = setup_telemetry("dart-env", version="0.1.0", run_id="r1",          # doctest: +SKIP
    ...                       config=TelemetryConfig(run_dir=Path("runs/r1")))
    >>> with tel.activate(), tel.tracer.start_as_current_span("reset"):         # doctest: +SKIP
    ...     tel.event("env.ready", env_id="env-0")
    >>> envs = tel.busy_tracker("env", "env-0")                                  # doctest: +SKIP
    >>> with envs.busy("step"):                                                  # doctest: +SKIP
    ...     ...
    >>> tel.shutdown()                                                           # doctest: +SKIP

Modules: :mod:`.setup` (config, :func:`setup_telemetry`, :class:`Telemetry`), :mod:`.routing`
(the global providers shared by several services in one process), :mod:`.jsonl` (the sink, its
record format and reader), :mod:`.busy` (busy trackers and interval arithmetic),
:mod:`.gpu` (NVML GPU sampling). Analytics over a run's records (utilization, the idle breakdown)
are in ``dart.cli.analytics``, where the CLI and the benchmarks use them.
"""

from dart.runtime.telemetry.busy import (
    BusyInterval,
    BusySection,
    BusyTracker,
    busy_ns,
    merge_intervals,
    utilization,
    utilization_timeline,
)
from dart.runtime.telemetry.gpu import GpuSampler, GpuSummary, gpu_summary
from dart.runtime.telemetry.jsonl import JsonlMetricExporter, JsonlSpanExporter, JsonlWriter, read_jsonl
from dart.runtime.telemetry.readers import LIFECYCLE_EVENTS, load_busy_intervals, observed_window
from dart.runtime.telemetry.setup import Telemetry, TelemetryConfig, current_telemetry, setup_telemetry

__all__ = [
    "LIFECYCLE_EVENTS",
    "BusyInterval",
    "BusySection",
    "BusyTracker",
    "GpuSampler",
    "GpuSummary",
    "JsonlMetricExporter",
    "JsonlSpanExporter",
    "JsonlWriter",
    "Telemetry",
    "TelemetryConfig",
    "busy_ns",
    "current_telemetry",
    "gpu_summary",
    "load_busy_intervals",
    "merge_intervals",
    "observed_window",
    "read_jsonl",
    "setup_telemetry",
    "utilization",
    "utilization_timeline",
]
