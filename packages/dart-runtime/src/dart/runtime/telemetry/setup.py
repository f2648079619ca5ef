"""One call to set up OpenTelemetry traces and metrics for a DART service.

Design (several services in one process): ``dart run`` hosts env, rollout, data and train in one
process, tests set telemetry up many times, yet OpenTelemetry lets a process install its global
providers once. So:

- every :func:`setup_telemetry` call builds the service's *own* SDK ``TracerProvider`` and
  ``MeterProvider`` with its own ``Resource`` (so each service keeps its ``service.name`` in
  Jaeger/Prometheus and in the JSONL), reachable as :attr:`Telemetry.tracer` / :attr:`Telemetry.meter`;
- the first call installs global *routing* providers (:mod:`dart.runtime.telemetry.routing`), once
  per process. Code that uses the global API (the bus client's ``trace.get_tracer("dart.runtime.bus")``)
  gets its spans and measurements delivered, when they are made, to the service made current with
  :meth:`Telemetry.activate` in that context (asyncio tasks inherit it), else to the first service
  set up that is still alive;
- shutting a service down flushes and closes only its own providers; later setups work normally.

Where a component takes a provider explicitly, pass the service's own and no routing is involved:
``Bus.connect(config, tracer_provider=telemetry.tracer_provider)``.

If other code installed a global provider before DART's first setup, DART keeps it (OTel cannot
replace it) and logs a warning; per-service tracers still work, global-API spans go there.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from pydantic import Field, field_validator

from dart.protocol.config import ConfigModel
from dart.runtime.telemetry.busy import BusyInterval, BusyTracker, Clock
from dart.runtime.telemetry.event_metrics import RESOURCE_LABELS, EventGauges
from dart.runtime.telemetry.jsonl import (
    RUN_ID_ATTRIBUTE,
    JsonlMetricExporter,
    JsonlSpanExporter,
    JsonlWriter,
    acquire_writer,
    identity,
    release_writer,
)
from dart.runtime.telemetry.routing import ROUTER, Route, RoutingMeterProvider, RoutingTracerProvider
from dart.runtime.telemetry.trackers import (
    DEFAULT_TRACKED_EVENTS,
    EventFilter,
    TrackerConfig,
    TrackerSet,
    open_trackers,
)

_log = logging.getLogger(__name__)


class TelemetryConfig(ConfigModel):
    """Where a service's traces, metrics and events go."""

    otlp_endpoint: str | None = None
    """Base URL of an OTLP/HTTP collector, e.g. ``http://otel-collector:4318``; ``/v1/traces`` and
    ``/v1/metrics`` are appended. When unset, the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and the
    per-signal ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT``) variables are honored; with none of
    them, nothing is sent over the network (the JSONL sink is always written)."""

    otlp_timeout_s: float = Field(default=5.0, gt=0)
    """Per-request timeout of OTLP exports, in seconds; bounds how long shutdown can wait on a dead collector."""

    run_dir: Path | None = None
    """Run directory; the JSONL sink is ``<run_dir>/telemetry/<service>.jsonl``. Default ``runs/<run_id>``."""

    jsonl_path: Path | None = None
    """Explicit JSONL file, overriding the ``run_dir`` layout."""

    metric_export_interval_s: float = Field(default=10.0, gt=0)
    """Seconds between metric collections (JSONL and OTLP)."""

    span_flush_interval_s: float = Field(default=1.0, gt=0)
    """Longest delay, in seconds, between a span ending and its export."""

    service_instance_id: str | None = None
    """``service.instance.id`` resource attribute; a random UUID per setup when unset."""

    trackers: list[TrackerConfig] = Field(default_factory=list)
    """Experiment trackers (TensorBoard, W&B, MLflow) that also receive tracked events' numbers; see
    :mod:`dart.runtime.telemetry.trackers`."""

    tracked_events: list[str] = Field(default_factory=lambda: list(DEFAULT_TRACKED_EVENTS))
    """Event names whose numeric attributes go to the trackers and become ``dart.<event>.<attribute>``
    gauges (an entry ending in ``.`` is a prefix); see :mod:`dart.runtime.telemetry.event_metrics`."""

    prometheus_port: int | None = Field(default=None, ge=0, le=65535)
    """Serve this service's metrics for Prometheus at ``http://<prometheus_host>:<port>/metrics``; 0 picks a
    free port (read it from ``Telemetry.prometheus_address``); None serves nothing."""

    prometheus_host: str = "127.0.0.1"
    """Interface of the Prometheus endpoint (``0.0.0.0`` in a container)."""

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL of an OTLP/HTTP collector, e.g. http://localhost:4318")
        return value.rstrip("/") if value else value

    def resolve_run_dir(self, run_id: str) -> Path:
        """The run directory a service with this config writes under."""
        return self.run_dir if self.run_dir is not None else Path("runs") / run_id

    def resolve_jsonl_path(self, service_name: str, run_id: str) -> Path:
        """The JSONL file a service with this config writes to."""
        if self.jsonl_path is not None:
            return self.jsonl_path
        return self.resolve_run_dir(run_id) / "telemetry" / f"{service_name}.jsonl"


class Telemetry:
    """A service's telemetry: tracer, meter, JSONL events and busy accounting.

    Lifecycle: ``running`` from :func:`setup_telemetry` -> ``shut down`` by :meth:`shutdown`
    (idempotent; also run at interpreter exit), after which spans and records are dropped.

    Attributes:
        service_name: ``service.name``.
        version: ``service.version``.
        run_id: ``dart.run_id``.
        instance_id: ``service.instance.id``.
        resource: The OTel resource all its telemetry carries.
        jsonl_path: The JSONL sink.
        tracer_provider: The service's own SDK tracer provider (not the global one).
        meter_provider: The service's own SDK meter provider (not the global one).
        otlp_endpoint: Where OTLP goes (``"env"`` when taken from OTEL_* variables), or None.
    """

    def __init__(
        self,
        *,
        service_name: str,
        version: str,
        run_id: str,
        instance_id: str,
        resource: Resource,
        jsonl_path: Path,
        tracer_provider: TracerProvider,
        meter_provider: MeterProvider,
        otlp_endpoint: str | None,
        experiment_trackers: TrackerSet | None = None,
        tracked_events: EventFilter | None = None,
        prometheus_server: Any = None,
    ) -> None:
        self.service_name = service_name
        self.version = version
        self.run_id = run_id
        self.instance_id = instance_id
        self.resource = resource
        self.jsonl_path = jsonl_path
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.otlp_endpoint = otlp_endpoint
        self.experiment_trackers = experiment_trackers
        """TensorBoard / W&B / MLflow trackers fed with tracked events, when configured."""
        self._prometheus = prometheus_server
        self._writer = acquire_writer(jsonl_path)
        self._identity = identity(resource)
        self._route = Route(service_name, tracer_provider, meter_provider, owner=self)
        self._trackers: weakref.WeakSet[BusyTracker] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._busy: tuple[metrics.Counter, metrics.UpDownCounter] | None = None
        self._stopping = False
        self._closed = False
        self.tracer = tracer_provider.get_tracer(service_name, version)
        """The service's tracer (instrumentation scope = service name)."""
        self.meter = meter_provider.get_meter(service_name, version)
        """The service's meter (instrumentation scope = service name)."""
        self._event_gauges = EventGauges(self.meter, tracked_events or EventFilter())

    @property
    def prometheus_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of this service's Prometheus endpoint, when one is served."""
        if self._prometheus is None:
            return None
        host, port = self._prometheus[0].server_address[:2]
        return str(host), int(port)

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` ran."""
        return self._closed

    def get_tracer(self, name: str, version: str | None = None) -> trace.Tracer:
        """A tracer of this service for another instrumentation scope (e.g. a library)."""
        return self.tracer_provider.get_tracer(name, version)

    def get_meter(self, name: str, version: str | None = None) -> metrics.Meter:
        """A meter of this service for another instrumentation scope."""
        return self.meter_provider.get_meter(name, version)

    @contextmanager
    def activate(self) -> Iterator[Telemetry]:
        """Route global-API spans and measurements made in this context to this service.

        Asyncio tasks created inside inherit the choice, so a service wraps its main coroutine::

            with telemetry.activate():
                await service.run()
        """
        token = ROUTER.activate(self._route)
        try:
            yield self
        finally:
            ROUTER.deactivate(token)

    def write_record(self, record_type: str, fields: dict[str, Any]) -> None:
        """Append a record of ``record_type`` with this service's identity fields to the JSONL sink.

        Dropped after :meth:`shutdown` (the file may be shared with a newer setup of the service).
        """
        if self._closed:
            return
        self._writer.write({"type": record_type, **self._identity, **fields})

    def event(self, name: str, /, **attrs: Any) -> None:
        """Write a structured event line; also added to the current span when one is recording.

        Args:
            name: Event name, dotted (``trajectory.done``, ``engine.updated``).
            **attrs: JSON-serializable attributes.
        """
        span = trace.get_current_span()
        ctx = span.get_span_context()
        now_ns = time.time_ns()
        if not self._closed:
            self._event_gauges.record(name, attrs)
            if self.experiment_trackers is not None:
                self.experiment_trackers.record(name, attrs, wall_time=now_ns / 1e9)
        self.write_record(
            "event",
            {
                "name": name,
                "ts_unix_ns": now_ns,
                "trace_id": trace.format_trace_id(ctx.trace_id) if ctx.is_valid else None,
                "span_id": trace.format_span_id(ctx.span_id) if ctx.is_valid else None,
                "attributes": attrs,
            },
        )
        if span.is_recording():
            span.add_event(
                name, {k: v if isinstance(v, str | bool | int | float) else str(v) for k, v in attrs.items()}
            )

    def busy_tracker(self, resource_kind: str, resource_id: str, *, clock: Clock = time.time_ns) -> BusyTracker:
        """A :class:`BusyTracker` reporting to this service."""
        return BusyTracker(resource_kind, resource_id, self, clock=clock)

    def track_busy(self, tracker: BusyTracker) -> None:
        """Keep ``tracker`` to checkpoint it at flush and shutdown (called by :class:`BusyTracker`)."""
        # Weak: a tracker dropped by its owner must not be kept alive by telemetry.
        self._trackers.add(tracker)

    def record_busy(self, tracker: BusyTracker, interval: BusyInterval | None, busy_delta: int) -> None:
        """Write a tracker's finished interval and busy-gauge change (called by :class:`BusyTracker`).

        Dropped after :meth:`shutdown`.
        """
        if self._closed:
            return
        busy_time, busy_now = self._busy_instruments()
        attrs = {"resource.kind": tracker.resource_kind, "resource.id": tracker.resource_id}
        if interval is not None:
            self.write_record("busy", interval.to_record())
            busy_time.add(interval.duration_s, {**attrs, "activity": interval.activity})
        if busy_delta:
            busy_now.add(busy_delta, attrs)

    def _busy_instruments(self) -> tuple[metrics.Counter, metrics.UpDownCounter]:
        if self._busy is None:
            with self._lock:
                if self._busy is None:
                    self._busy = (
                        self.meter.create_counter(
                            "dart.resource.busy.time", unit="s", description="Seconds a resource was busy, by activity"
                        ),
                        self.meter.create_up_down_counter(
                            "dart.resource.busy", unit="{resource}", description="1 while the resource is busy"
                        ),
                    )
        return self._busy

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export pending spans and collect metrics now; True if everything made it in time."""
        for tracker in list(self._trackers):
            tracker.checkpoint()
        millis = int(timeout_s * 1000)
        spans_ok = self.tracer_provider.force_flush(millis)
        metrics_ok = self.meter_provider.force_flush(millis)
        return spans_ok and metrics_ok

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Flush everything and close this service's providers and its share of the JSONL file."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        for tracker in list(self._trackers):
            tracker.checkpoint()
        self.event("telemetry.stop")
        # Stop routing global spans here first, so none reach a provider that is shutting down.
        ROUTER.unregister(self._route)
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
        if self.experiment_trackers is not None:
            self.experiment_trackers.close()
        if self._prometheus is not None:
            server, thread = self._prometheus
            server.shutdown()
            server.server_close()
            thread.join(timeout=timeout_s)
        # Closed only now: the final checkpoints and metric collection above still write.
        self._closed = True
        release_writer(self._writer)

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"Telemetry({self.service_name!r}, run_id={self.run_id!r}, jsonl={str(self.jsonl_path)!r}, {state})"


_GLOBALS_LOCK = threading.Lock()
_globals_installed: bool | None = None


def _install_global_providers() -> bool:
    """Install the routing providers as OTel's globals, once per process; True if they are ours."""
    global _globals_installed
    with _GLOBALS_LOCK:
        if _globals_installed is None:
            tracer_provider = RoutingTracerProvider(ROUTER)
            meter_provider = RoutingMeterProvider(ROUTER)
            if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
                trace.set_tracer_provider(tracer_provider)
            metrics.set_meter_provider(meter_provider)
            _globals_installed = (
                trace.get_tracer_provider() is tracer_provider and metrics.get_meter_provider() is meter_provider
            )
            if not _globals_installed:
                _log.warning(
                    "a global OpenTelemetry provider was installed before DART's telemetry setup; spans and "
                    "metrics made through the global API (e.g. by the bus client) go to it, not to DART's sinks"
                )
        return _globals_installed


def current_telemetry() -> Telemetry | None:
    """The :class:`Telemetry` global-API spans go to in this context (see :meth:`Telemetry.activate`)."""
    route = ROUTER.current()
    owner = route.owner if route is not None else None
    return owner if isinstance(owner, Telemetry) else None


def _otlp_target(config: TelemetryConfig) -> tuple[str | None, str | None, bool, bool]:
    # Returns (explicit base URL, label, export traces, export metrics). With only OTEL_* variables set,
    # the exporters are built without an endpoint so they apply the standard precedence and path rules
    # themselves; a signal is exported only when the general or its own variable names an endpoint
    # (e.g. traces to a collector while Prometheus scrapes the metrics).
    if config.otlp_endpoint:
        return config.otlp_endpoint, config.otlp_endpoint, True, True
    general = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    traces = general or bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    metrics = general or bool(os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))
    return None, ("env" if traces or metrics else None), traces, metrics


def setup_telemetry(
    service_name: str, *, version: str, run_id: str, config: TelemetryConfig | None = None
) -> Telemetry:
    """Set up traces and metrics for one service: JSONL sink always, OTLP/HTTP when configured.

    Safe to call several times per process (one per service, or once per test); see the module
    docstring for how the global OpenTelemetry providers are shared.

    Args:
        service_name: ``service.name``, e.g. ``dart-env``; also the JSONL file name.
        version: ``service.version``.
        run_id: The DART run this service belongs to (``dart.run_id``).
        config: Sinks and intervals; defaults write ``runs/<run_id>/telemetry/<service>.jsonl``.

    Returns:
        The handle to trace, measure, write events and shut down with.
    """
    config = config or TelemetryConfig()
    instance_id = config.service_instance_id or str(uuid.uuid4())
    resource = Resource.create(
        {
            "service.name": service_name,
            "service.namespace": "dart",
            "service.version": version,
            "service.instance.id": instance_id,
            RUN_ID_ATTRIBUTE: run_id,
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
        }
    )
    jsonl_path = config.resolve_jsonl_path(service_name, run_id)
    writer = acquire_writer(jsonl_path)
    base_url, otlp_label, otlp_traces, otlp_metrics = _otlp_target(config)
    try:
        tracer_provider = _tracer_provider(config, resource, writer, otlp=otlp_traces, base_url=base_url)
        readers, prometheus = _metric_readers(config, writer, otlp=otlp_metrics, base_url=base_url)
        meter_provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
        experiment_trackers = (
            open_trackers(
                config.trackers,
                run_dir=config.resolve_run_dir(run_id),
                run_id=run_id,
                service=service_name,
                tracked_events=config.tracked_events,
            )
            if config.trackers
            else None
        )
        telemetry = Telemetry(
            service_name=service_name,
            version=version,
            run_id=run_id,
            instance_id=instance_id,
            resource=resource,
            jsonl_path=jsonl_path,
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
            otlp_endpoint=otlp_label,
            experiment_trackers=experiment_trackers,
            tracked_events=EventFilter(config.tracked_events),
            prometheus_server=prometheus,
        )
    finally:
        # Telemetry holds its own reference; this one only kept the file open while building.
        release_writer(writer)
    ROUTER.register(telemetry._route)
    _install_global_providers()
    telemetry.event("telemetry.start", version=version, pid=os.getpid(), otlp=otlp_label)
    return telemetry


# The SDK's self-observability metrics would otherwise go through the global meter provider, i.e. into
# every service's JSONL; they are not what a DART report is about.
_QUIET = NoOpMeterProvider()


def _tracer_provider(
    config: TelemetryConfig, resource: Resource, writer: JsonlWriter, *, otlp: bool, base_url: str | None
) -> TracerProvider:
    """Spans to the JSONL sink, and with ``otlp`` over OTLP/HTTP (to ``base_url``, else where ``OTEL_*`` say)."""
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False, meter_provider=_QUIET)
    flush_ms = config.span_flush_interval_s * 1000
    tracer_provider.add_span_processor(
        BatchSpanProcessor(JsonlSpanExporter(writer), schedule_delay_millis=flush_ms, meter_provider=_QUIET)
    )
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter(
            endpoint=f"{base_url}/v1/traces" if base_url else None,
            timeout=config.otlp_timeout_s,
            meter_provider=_QUIET,
        )
        tracer_provider.add_span_processor(
            BatchSpanProcessor(span_exporter, schedule_delay_millis=flush_ms, meter_provider=_QUIET)
        )
    return tracer_provider


def _metric_readers(
    config: TelemetryConfig, writer: JsonlWriter, *, otlp: bool, base_url: str | None
) -> tuple[list[MetricReader], Any]:
    """Metric readers (JSONL; OTLP/HTTP with ``otlp``; Prometheus when a port is set) and the Prometheus server."""
    interval_ms = config.metric_export_interval_s * 1000
    readers: list[MetricReader] = [
        PeriodicExportingMetricReader(JsonlMetricExporter(writer), export_interval_millis=interval_ms)
    ]
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        metric_exporter = OTLPMetricExporter(
            endpoint=f"{base_url}/v1/metrics" if base_url else None,
            timeout=config.otlp_timeout_s,
            meter_provider=_QUIET,
        )
        readers.append(PeriodicExportingMetricReader(metric_exporter, export_interval_millis=interval_ms))
    prometheus = None
    if config.prometheus_port is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_wsgi_server

        # A registry per service: several services in one process must not mix their series.
        registry = CollectorRegistry(auto_describe=True)
        readers.append(
            PrometheusMetricReader(resource_attribute_filter=RESOURCE_LABELS.__contains__, registry=registry)
        )
        prometheus = start_wsgi_server(config.prometheus_port, addr=config.prometheus_host, registry=registry)
    return readers, prometheus


@atexit.register
def _shutdown_all() -> None:
    # Services that never called shutdown() still get their last spans and metrics written.
    for route in reversed(ROUTER.routes()):
        if isinstance(route.owner, Telemetry):
            owner = route.owner
            owner.shutdown(timeout_s=2.0)
