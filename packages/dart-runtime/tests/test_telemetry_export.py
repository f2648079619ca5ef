"""Metrics reach the JSONL sink; OTLP/HTTP goes to a real (loopback) HTTP endpoint when configured."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import metrics
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

from dart.protocol.config import load_config
from dart.protocol.errors import ConfigError
from dart.runtime.telemetry import TelemetryConfig, read_jsonl, setup_telemetry

pytestmark = pytest.mark.unit


def metric_points(path: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(path, types={"metric"}) if r["name"] == name]


def test_metrics_are_exported_at_shutdown(tmp_path: Path) -> None:
    tel = setup_telemetry("dart-rollout", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path))
    tokens = tel.meter.create_counter("dart.rollout.tokens", unit="{token}")
    latency = tel.meter.create_histogram("dart.rollout.step.latency", unit="s")
    queue = tel.meter.create_up_down_counter("dart.rollout.queue.depth")
    tokens.add(100, {"engine": "e0"})
    tokens.add(50, {"engine": "e0"})
    tokens.add(7, {"engine": "e1"})
    for value in (0.1, 0.2, 0.3):
        latency.record(value)
    queue.add(5)
    queue.add(-2)
    tel.shutdown()  # the metric interval (10 s) has not elapsed: shutdown must collect

    by_engine = {p["attributes"]["engine"]: p["value"] for p in metric_points(tel.jsonl_path, "dart.rollout.tokens")}
    assert by_engine == {"e0": 150, "e1": 7}
    (hist,) = metric_points(tel.jsonl_path, "dart.rollout.step.latency")
    assert (hist["metric_type"], hist["count"], hist["min"], hist["max"]) == ("histogram", 3, 0.1, 0.3)
    assert hist["sum"] == pytest.approx(0.6)
    assert sum(hist["bucket_counts"]) == 3
    (depth,) = metric_points(tel.jsonl_path, "dart.rollout.queue.depth")
    assert (depth["metric_type"], depth["monotonic"], depth["value"]) == ("sum", False, 3)
    assert depth["service"] == "dart-rollout" and depth["run_id"] == "r"
    assert depth["time_unix_ns"] >= depth["start_unix_ns"] > 0


def test_metrics_are_exported_periodically(tmp_path: Path) -> None:
    tel = setup_telemetry(
        "svc", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path, metric_export_interval_s=0.05)
    )
    try:
        tel.meter.create_counter("ticks").add(3)
        deadline = time.monotonic() + 5
        while not metric_points(tel.jsonl_path, "ticks") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metric_points(tel.jsonl_path, "ticks")[-1]["value"] == 3
    finally:
        tel.shutdown()


def test_global_meter_instruments_route_per_measurement(tmp_path: Path) -> None:
    # Instruments created once at import time (before any service) still report to whichever
    # service is active when each measurement is made.
    messages = metrics.get_meter("dart.runtime.bus").create_counter("dart.bus.messages")
    cfg = TelemetryConfig(run_dir=tmp_path)
    env = setup_telemetry("dart-env", version="1", run_id="r", config=cfg)
    data = setup_telemetry("dart-data", version="1", run_id="r", config=cfg)
    with env.activate():
        messages.add(2)
    with data.activate():
        messages.add(5)
        messages.add(1)
    env.shutdown()
    data.shutdown()
    assert [p["value"] for p in metric_points(env.jsonl_path, "dart.bus.messages")] == [2]
    assert [p["value"] for p in metric_points(data.jsonl_path, "dart.bus.messages")] == [6]
    assert metric_points(data.jsonl_path, "dart.bus.messages")[0]["scope"] == "dart.runtime.bus"


class _Collector:
    """A loopback HTTP server recording OTLP/HTTP POSTs."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, int]] = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                received.append((self.path, self.headers.get("Content-Type", ""), len(body)))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def paths(self) -> set[str]:
        return {path for path, _, _ in self.requests}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()


@pytest.fixture
def collector() -> Iterator[_Collector]:
    c = _Collector()
    yield c
    c.close()


def test_otlp_endpoint_receives_traces_and_metrics(collector: _Collector, tmp_path: Path) -> None:
    tel = setup_telemetry(
        "dart-train", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path, otlp_endpoint=collector.url)
    )
    assert tel.otlp_endpoint == collector.url
    with tel.tracer.start_as_current_span("train.step"):
        tel.meter.create_counter("dart.train.steps").add(1)
    tel.shutdown()
    assert {"/v1/traces", "/v1/metrics"} <= collector.paths()
    assert all(ctype == "application/x-protobuf" and size > 0 for _, ctype, size in collector.requests)
    # The JSONL sink is written whether or not OTLP is on.
    assert any(r["name"] == "train.step" for r in read_jsonl(tel.jsonl_path, types={"span"}))


def test_standard_otel_endpoint_variable_is_honored(
    collector: _Collector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
    tel = setup_telemetry("svc", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path))
    assert tel.otlp_endpoint == "env"
    tel.tracer.start_span("s").end()
    tel.shutdown()
    assert "/v1/traces" in collector.paths()


def test_a_traces_only_endpoint_exports_only_traces(
    collector: _Collector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The compose stack sends traces to the collector while Prometheus scrapes the metrics.
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{collector.url}/v1/traces")
    config = TelemetryConfig(run_dir=tmp_path, metric_export_interval_s=0.05)
    tel = setup_telemetry("svc", version="1", run_id="r", config=config)
    assert tel.otlp_endpoint == "env"
    tel.meter.create_counter("dart.test.count").add(1)
    tel.tracer.start_span("s").end()
    # Without an endpoint of its own a metric exporter would send to the default (localhost:4318),
    # not to the collector: look at the readers themselves.
    exporters = [getattr(r, "_exporter", None) for r in tel.meter_provider._metric_readers]
    tel.shutdown()
    assert "/v1/traces" in collector.paths()
    assert not any(isinstance(e, OTLPMetricExporter) for e in exporters), exporters


def test_no_endpoint_means_no_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ):
        monkeypatch.delenv(var, raising=False)
    tel = setup_telemetry("svc", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path))
    tel.shutdown()
    assert tel.otlp_endpoint is None


def test_telemetry_config_errors_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("otlp_endpoint: collector:4318\nmetric_export_interval_s: 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(TelemetryConfig, path, environ={})
    message = str(info.value)
    assert "field 'otlp_endpoint': Value error, must be an http:// or https:// URL" in message
    assert "field 'metric_export_interval_s': Input should be greater than 0" in message
    ok = load_config(TelemetryConfig, None, environ={"DART_OTLP_ENDPOINT": "http://c:4318/"})
    assert ok.otlp_endpoint == "http://c:4318"
