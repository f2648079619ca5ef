"""The local JSONL telemetry sink: an append-only file of one JSON object per line.

Every service always writes one, whatever OTLP does, and the run report, benchmarks and
``dart.cli.analytics.resource_utilization`` read it back. Records share these fields:

- ``type``: ``span``, ``metric``, ``event`` or ``busy``.
- ``service``, ``service_instance``, ``run_id``: who wrote it (from the OTel resource).

and then, per type:

- ``span``: ``name``, ``scope``, ``kind`` (``INTERNAL``/``SERVER``/``CLIENT``/...), ``trace_id``
  (32 hex), ``span_id`` (16 hex), ``parent_span_id`` (16 hex or null), ``start_unix_ns``,
  ``end_unix_ns``, ``duration_s``, ``status`` (``UNSET``/``OK``/``ERROR``), ``status_description``,
  ``attributes``, ``events`` (``name``, ``ts_unix_ns``, ``attributes``), ``links``.
- ``metric`` (one line per data point, cumulative temporality): ``name``, ``scope``, ``unit``,
  ``description``, ``metric_type`` (``sum``/``gauge``/``histogram``/``exponential_histogram``),
  ``monotonic`` (sums), ``attributes``, ``start_unix_ns``, ``time_unix_ns`` and ``value`` (sum,
  gauge) or ``count``/``sum``/``min``/``max``/``bucket_counts``/``explicit_bounds`` (histograms).
- ``event``: ``name``, ``ts_unix_ns``, ``trace_id``/``span_id`` of the span current when it was
  written (or null), ``attributes``.
- ``busy``: ``resource_kind``, ``resource_id``, ``activity``, ``start_unix_ns``, ``end_unix_ns``,
  ``duration_s``; intervals from one tracker never overlap (see :class:`BusyTracker`).

Writing is thread-safe and each batch of lines is one ``write(2)`` on an ``O_APPEND`` descriptor,
so lines from several services, threads or processes never interleave on a local file system,
and a reader sees every complete line as soon as it is written (there is no user-space buffer).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk import metrics as sdk_metrics
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ExponentialHistogram,
    Gauge,
    Histogram,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import format_span_id, format_trace_id

_log = logging.getLogger(__name__)

RUN_ID_ATTRIBUTE = "dart.run_id"
"""Resource attribute naming the DART run a service belongs to."""


class JsonlWriter:
    """Thread-safe, append-only JSONL file.

    Lifecycle: ``open`` on construction (the file and its parent directories are created) ->
    ``closed`` on :meth:`close`. Records written after close are dropped and counted in
    :attr:`dropped`, because telemetry must never crash the service that produces it.

    Args:
        path: File to append to.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self._lock = threading.Lock()
        self.dropped = 0
        """Records dropped because the writer was closed."""

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._fd is None

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record as one line."""
        self.write_many((record,))

    def write_many(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Append records, one line each, in a single write so they stay contiguous."""
        lines = [json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in records]
        if not lines:
            return
        data = "".join(lines).encode("utf-8")
        with self._lock:
            if self._fd is None:
                self.dropped += len(lines)
                return
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]

    def sync(self) -> None:
        """fsync the file, for durability across a machine crash (visibility needs no sync)."""
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)

    def close(self) -> None:
        """Close the file. Idempotent."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


_WRITERS: dict[Path, tuple[JsonlWriter, int]] = {}
_WRITERS_LOCK = threading.Lock()


def acquire_writer(path: Path) -> JsonlWriter:
    """Get the process-wide writer for ``path``, opening it on first use.

    Services in one process that log to the same file share one writer (and one lock), which is
    what keeps their lines whole. Pair every call with :func:`release_writer`.
    """
    key = Path(path).resolve()
    with _WRITERS_LOCK:
        writer, refs = _WRITERS.get(key, (None, 0))
        if writer is None or writer.closed:
            writer, refs = JsonlWriter(key), 0
        _WRITERS[key] = (writer, refs + 1)
        return writer


def release_writer(writer: JsonlWriter) -> None:
    """Drop one reference to a shared writer; the last one closes the file."""
    with _WRITERS_LOCK:
        current, refs = _WRITERS.get(writer.path, (None, 0))
        if current is not writer:
            writer.close()
            return
        if refs <= 1:
            del _WRITERS[writer.path]
            writer.close()
        else:
            _WRITERS[writer.path] = (writer, refs - 1)


def identity(resource: Resource) -> dict[str, Any]:
    """The ``service``/``service_instance``/``run_id`` fields every record carries."""
    attrs = resource.attributes
    return {
        "service": attrs.get("service.name"),
        "service_instance": attrs.get("service.instance.id"),
        "run_id": attrs.get(RUN_ID_ATTRIBUTE),
    }


def _attrs(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    # OTel attribute values are scalars or tuples of scalars; JSON wants lists.
    if not attributes:
        return {}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items()}


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """Convert a finished span into its JSONL record."""
    ctx = span.get_span_context()
    start = span.start_time or 0
    end = span.end_time or start
    scope = span.instrumentation_scope
    return {
        "type": "span",
        **identity(span.resource),
        "name": span.name,
        "scope": scope.name if scope else None,
        "kind": span.kind.name,
        "trace_id": format_trace_id(ctx.trace_id) if ctx else None,
        "span_id": format_span_id(ctx.span_id) if ctx else None,
        "parent_span_id": format_span_id(span.parent.span_id) if span.parent else None,
        "start_unix_ns": start,
        "end_unix_ns": end,
        "duration_s": (end - start) / 1e9,
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "attributes": _attrs(span.attributes),
        "events": [
            {"name": e.name, "ts_unix_ns": e.timestamp, "attributes": _attrs(e.attributes)} for e in span.events
        ],
        "links": [
            {"trace_id": format_trace_id(link.context.trace_id), "span_id": format_span_id(link.context.span_id)}
            for link in span.links
        ],
    }


class JsonlSpanExporter(SpanExporter):
    """Span exporter appending one ``span`` record per finished span to a :class:`JsonlWriter`."""

    def __init__(self, writer: JsonlWriter) -> None:
        self._writer = writer

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write the spans; never raises (a failed write is logged and reported as FAILURE)."""
        try:
            self._writer.write_many(span_record(s) for s in spans)
        except OSError:
            _log.exception("cannot write spans to %s", self._writer.path)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Nothing is buffered here: every export is already written."""
        return True

    def shutdown(self) -> None:
        """The shared writer is closed by its owner, not by the exporter."""


def _point_fields(data: Sum | Gauge | Histogram | ExponentialHistogram) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Yield each data point with its type-specific fields."""
    if isinstance(data, Sum):
        for p in data.data_points:
            yield p, {"metric_type": "sum", "monotonic": data.is_monotonic, "value": p.value}
    elif isinstance(data, Gauge):
        for p in data.data_points:
            yield p, {"metric_type": "gauge", "value": p.value}
    elif isinstance(data, Histogram):
        for h in data.data_points:
            yield (
                h,
                {
                    "metric_type": "histogram",
                    "count": h.count,
                    "sum": h.sum,
                    "min": h.min,
                    "max": h.max,
                    "bucket_counts": list(h.bucket_counts),
                    "explicit_bounds": list(h.explicit_bounds),
                },
            )
    else:
        for e in data.data_points:
            yield (
                e,
                {"metric_type": "exponential_histogram", "count": e.count, "sum": e.sum, "min": e.min, "max": e.max},
            )


def metric_records(metrics_data: MetricsData) -> Iterator[dict[str, Any]]:
    """Convert collected metrics into JSONL records, one per data point."""
    for rm in metrics_data.resource_metrics:
        who = identity(rm.resource)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point, fields in _point_fields(metric.data):
                    yield {
                        "type": "metric",
                        **who,
                        "name": metric.name,
                        "scope": sm.scope.name,
                        "unit": metric.unit,
                        "description": metric.description,
                        "attributes": _attrs(point.attributes),
                        "start_unix_ns": point.start_time_unix_nano,
                        "time_unix_ns": point.time_unix_nano,
                        **fields,
                    }


class JsonlMetricExporter(MetricExporter):
    """Metric exporter appending one ``metric`` record per data point to a :class:`JsonlWriter`.

    Cumulative temporality for every instrument, so the last record of a series is its total:
    a reader never has to sum deltas (and a lost line loses nothing).
    """

    def __init__(self, writer: JsonlWriter) -> None:
        kinds: list[type] = [
            sdk_metrics.Counter,
            sdk_metrics.UpDownCounter,
            sdk_metrics.Histogram,
            sdk_metrics.ObservableCounter,
            sdk_metrics.ObservableUpDownCounter,
            sdk_metrics.ObservableGauge,
            sdk_metrics._Gauge,
        ]
        super().__init__(preferred_temporality=dict.fromkeys(kinds, AggregationTemporality.CUMULATIVE))
        self._writer = writer

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        """Write the data points; never raises."""
        try:
            self._writer.write_many(metric_records(metrics_data))
        except OSError:
            _log.exception("cannot write metrics to %s", self._writer.path)
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Nothing is buffered here."""
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """The shared writer is closed by its owner, not by the exporter."""


def jsonl_files(source: str | Path | Iterable[str | Path]) -> list[Path]:
    """Expand a file, a directory (every ``*.jsonl`` below it) or several of them into files."""
    items: Iterable[str | Path] = [source] if isinstance(source, str | Path) else source
    files: list[Path] = []
    for item in items:
        p = Path(item)
        files.extend(sorted(p.rglob("*.jsonl")) if p.is_dir() else [p])
    return files


def read_jsonl(
    source: str | Path | Iterable[str | Path], *, types: Iterable[str] | None = None, strict: bool = False
) -> Iterator[dict[str, Any]]:
    """Read telemetry records back, e.g. while the service that writes them is still running.

    Args:
        source: A JSONL file, a directory searched recursively for ``*.jsonl``, or a list of them.
        types: Only yield records whose ``type`` is one of these (e.g. ``{"busy"}``).
        strict: Raise on a malformed line instead of skipping it. A last line without its newline
            is a record still being written and is always skipped.

    Raises:
        FileNotFoundError: A named file does not exist.
        ValueError: ``strict`` and a complete line is not a JSON object.
    """
    wanted = set(types) if types is not None else None
    for path in jsonl_files(source):
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.endswith("\n"):
                    break
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    if strict:
                        raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from exc
                    continue
                if not isinstance(record, dict):
                    if strict:
                        raise ValueError(f"{path}:{lineno}: not a JSON object")
                    continue
                if wanted is None or record.get("type") in wanted:
                    yield record
