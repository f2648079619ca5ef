"""Tracked events as OpenTelemetry gauges, and a Prometheus endpoint per service.

The numbers researchers watch in trackers (see :mod:`dart.runtime.telemetry.trackers`) are also what
an operator's dashboards need. Each numeric attribute of a tracked event becomes the gauge
``dart.<event>.<attribute>`` holding its latest value (``dart.trainer.step.loss``,
``dart.data.batch.max_staleness``); Prometheus shows it as ``dart_trainer_step_loss`` (attributes ending
in ``_s`` are seconds: ``dart_trainer_step_duration_s_seconds``). Together with the busy-time counter
``dart.resource.busy.time`` (``dart_resource_busy_time_seconds_total``, labelled by resource kind, id and
activity) they cover utilization, staleness, success, throughput and weight sync. The gauges go wherever
the service's metrics go: the JSONL sink, OTLP when configured, and Prometheus when
``TelemetryConfig.prometheus_port`` is set.

Each service serves its own registry (``/metrics`` on ``prometheus_host:prometheus_port``), so several
services in one process (tests, ``dart eval``) do not mix their series; the labels ``service_name``,
``service_instance_id`` and ``dart_run_id`` come from the service's resource.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics

from dart.runtime.telemetry.trackers import EventFilter, numeric_attributes

_INVALID = re.compile(r"[^A-Za-z0-9_.\\-]")

RESOURCE_LABELS = frozenset({"service.name", "service.instance.id", "dart.run_id"})
"""Resource attributes copied as labels onto every Prometheus series."""

EVENT_LABELS: Mapping[str, tuple[str, ...]] = {
    "data.rejected": ("reason",),
    "engine.update.end": ("engine_id",),
    "gpu.sample": ("source", "gpu"),
}
"""Attributes of an event that say *which* thing it is about: they label its gauges (one series per engine,
per GPU) instead of becoming gauges themselves."""


def gauge_name(event: str, attribute: str) -> str:
    """The OpenTelemetry instrument name of one event attribute, e.g. ``dart.trainer.step.loss``."""
    return _INVALID.sub("_", f"dart.{event}.{attribute}")[:255]


class EventGauges:
    """Sets a gauge per numeric attribute of each tracked event (created on first use). Thread-safe.

    Args:
        meter: The service's meter.
        tracks: Which event names are tracked.
    """

    def __init__(self, meter: metrics.Meter, tracks: EventFilter) -> None:
        self._meter = meter
        self.tracks = tracks
        self._gauges: dict[str, metrics._Gauge] = {}
        self._lock = threading.Lock()

    def record(self, name: str, attrs: Mapping[str, Any]) -> None:
        """Set the gauges of one event's numbers, labelled by its :data:`EVENT_LABELS` (untracked events are
        ignored)."""
        if not self.tracks(name):
            return
        label_keys = EVENT_LABELS.get(name, ())
        labels = {key: str(attrs[key]) for key in label_keys if key in attrs}
        for key, value in numeric_attributes(attrs).items():
            if key not in label_keys:
                self._gauge(name, key).set(value, attributes=labels)

    def _gauge(self, event: str, attribute: str) -> metrics._Gauge:
        instrument = gauge_name(event, attribute)
        gauge = self._gauges.get(instrument)
        if gauge is None:
            with self._lock:
                gauge = self._gauges.get(instrument)
                if gauge is None:
                    unit = "s" if attribute.endswith("_s") else ""
                    gauge = self._meter.create_gauge(instrument, unit=unit, description=f"latest {event} {attribute}")
                    self._gauges[instrument] = gauge
        return gauge
