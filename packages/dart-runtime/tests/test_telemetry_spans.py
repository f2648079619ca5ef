"""Spans and events land in the JSONL sink, per service, with correct ids; the sink is safe to share."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from dart.runtime.telemetry import Telemetry, TelemetryConfig, current_telemetry, read_jsonl, setup_telemetry

pytestmark = pytest.mark.unit

MakeTelemetry = Callable[..., Telemetry]


@pytest.fixture
def make_telemetry(tmp_path: Path) -> Iterator[MakeTelemetry]:
    """Factory of telemetry handles writing under tmp_path; all are shut down at teardown."""
    made: list[Telemetry] = []

    def make(service: str = "svc", **config: Any) -> Telemetry:
        config.setdefault("run_dir", tmp_path)
        tel = setup_telemetry(service, version="9.9.9", run_id="run-1", config=TelemetryConfig(**config))
        made.append(tel)
        return tel

    yield make
    for tel in made:
        tel.shutdown()


def spans_by_name(path: Path) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in read_jsonl(path, types={"span"})}


def test_nested_spans_have_parent_ids_and_fields(make_telemetry: MakeTelemetry, tmp_path: Path) -> None:
    tel = make_telemetry("dart-env")
    with tel.tracer.start_as_current_span("root", kind=SpanKind.SERVER, attributes={"task": "t1", "ids": (1, 2)}):
        with tel.tracer.start_as_current_span("child"):
            with tel.tracer.start_as_current_span("grandchild"):
                pass
        with pytest.raises(RuntimeError), tel.tracer.start_as_current_span("failing"):
            raise RuntimeError("boom")
    tel.shutdown()

    assert tel.jsonl_path == tmp_path / "telemetry" / "dart-env.jsonl"
    spans = spans_by_name(tel.jsonl_path)
    root, child, grandchild, failing = (spans[n] for n in ("root", "child", "grandchild", "failing"))
    assert root["parent_span_id"] is None
    assert child["parent_span_id"] == root["span_id"]
    assert grandchild["parent_span_id"] == child["span_id"]
    assert failing["parent_span_id"] == root["span_id"]
    assert {s["trace_id"] for s in spans.values()} == {root["trace_id"]}
    assert len(root["trace_id"]) == 32 and len(root["span_id"]) == 16
    assert root["kind"] == "SERVER" and child["kind"] == "INTERNAL"
    assert root["attributes"] == {"task": "t1", "ids": [1, 2]}
    assert (root["service"], root["run_id"], root["service_instance"]) == ("dart-env", "run-1", tel.instance_id)
    assert root["scope"] == "dart-env"
    assert root["start_unix_ns"] <= child["start_unix_ns"] <= child["end_unix_ns"] <= root["end_unix_ns"]
    assert root["duration_s"] == pytest.approx((root["end_unix_ns"] - root["start_unix_ns"]) / 1e9)
    assert failing["status"] == StatusCode.ERROR.name
    assert "boom" in failing["status_description"]
    assert [e["name"] for e in failing["events"]] == ["exception"]


def test_resource_carries_service_identity(make_telemetry: MakeTelemetry) -> None:
    tel = make_telemetry("dart-data", service_instance_id="data-0")
    attrs = tel.resource.attributes
    assert attrs["service.name"] == "dart-data"
    assert attrs["service.version"] == "9.9.9"
    assert attrs["service.instance.id"] == "data-0"
    assert attrs["dart.run_id"] == "run-1"


def test_global_tracer_routes_to_the_active_service(make_telemetry: MakeTelemetry) -> None:
    # The bus client traces through the global API; in a multi-service process each span must
    # land in the service that made it.
    env, data = make_telemetry("dart-env"), make_telemetry("dart-data")
    bus_tracer = trace.get_tracer("dart.runtime.bus")
    with env.activate():
        assert current_telemetry() is env
        with env.tracer.start_as_current_span("env.step"), bus_tracer.start_as_current_span("bus.publish"):
            pass
    with data.activate():
        assert current_telemetry() is data
        bus_tracer.start_span("bus.request", kind=SpanKind.CLIENT).end()
    env.shutdown()
    data.shutdown()

    env_spans, data_spans = spans_by_name(env.jsonl_path), spans_by_name(data.jsonl_path)
    assert set(env_spans) == {"env.step", "bus.publish"}
    assert env_spans["bus.publish"]["parent_span_id"] == env_spans["env.step"]["span_id"]
    assert env_spans["bus.publish"]["scope"] == "dart.runtime.bus"
    assert set(data_spans) == {"bus.request"}
    assert data_spans["bus.request"]["service"] == "dart-data"


def test_a_closed_service_is_no_longer_routed_to(make_telemetry: MakeTelemetry) -> None:
    first, second = make_telemetry("first"), make_telemetry("second")
    second.shutdown()
    with second.activate():
        # Its route is closed: the span goes to a live service instead of being lost.
        trace.get_tracer("lib").start_span("after-close").end()
        assert current_telemetry() is not second
    with first.activate():
        trace.get_tracer("lib").start_span("in-first").end()
    first.shutdown()
    assert "after-close" not in spans_by_name(second.jsonl_path)
    assert "in-first" in spans_by_name(first.jsonl_path)


def test_event_lines_carry_the_current_span(make_telemetry: MakeTelemetry) -> None:
    tel = make_telemetry()
    tel.event("outside", n=1)
    with tel.tracer.start_as_current_span("work") as span:
        tel.event("inside", name="not-the-event-name", shape=[2, 3])
        span_id = f"{span.get_span_context().span_id:016x}"
    tel.shutdown()
    events = {r["name"]: r for r in read_jsonl(tel.jsonl_path, types={"event"})}
    assert events["outside"]["span_id"] is None
    assert events["outside"]["attributes"] == {"n": 1}
    assert events["inside"]["span_id"] == span_id
    assert events["inside"]["attributes"] == {"name": "not-the-event-name", "shape": [2, 3]}
    assert {"telemetry.start", "telemetry.stop"} <= set(events)
    work = spans_by_name(tel.jsonl_path)["work"]
    assert [e["name"] for e in work["events"]] == ["inside"]


def test_records_are_readable_while_the_service_runs(make_telemetry: MakeTelemetry) -> None:
    tel = make_telemetry(span_flush_interval_s=0.05)
    tel.event("live", k="v")
    # No flush, no shutdown: an event is one write(2), visible to any reader at once.
    assert [r["name"] for r in read_jsonl(tel.jsonl_path, types={"event"})][-1] == "live"
    with tel.tracer.start_as_current_span("soon"):
        pass
    assert tel.flush()
    assert "soon" in spans_by_name(tel.jsonl_path)


def test_repeated_setup_appends_to_the_same_file(make_telemetry: MakeTelemetry) -> None:
    first = make_telemetry("svc")
    with first.tracer.start_as_current_span("one"):
        pass
    first.shutdown()
    first.shutdown()  # idempotent
    second = make_telemetry("svc")
    with second.tracer.start_as_current_span("two"):
        pass
    second.shutdown()
    assert first.jsonl_path == second.jsonl_path
    starts = [r for r in read_jsonl(first.jsonl_path, types={"event"}) if r["name"] == "telemetry.start"]
    assert [s["service_instance"] for s in starts] == [first.instance_id, second.instance_id]
    assert {"one", "two"} <= set(spans_by_name(first.jsonl_path))


def test_services_sharing_a_file_write_whole_lines_from_many_threads(
    make_telemetry: MakeTelemetry, tmp_path: Path
) -> None:
    shared = tmp_path / "all.jsonl"
    a, b = make_telemetry("a", jsonl_path=shared), make_telemetry("b", jsonl_path=shared)

    def spam(tel: Telemetry, worker: int) -> None:
        for i in range(200):
            tel.event("tick", worker=worker, i=i, pad="x" * 500)

    threads = [threading.Thread(target=spam, args=(tel, w)) for w, tel in enumerate([a, b] * 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.shutdown()
    b.shutdown()
    lines = shared.read_text().splitlines()
    ticks = [json.loads(line) for line in lines if '"tick"' in line]  # json.loads fails on a torn line
    assert len(ticks) == 8 * 200
    assert {(t["service"], t["attributes"]["worker"]) for t in ticks} == {("ab"[w % 2], w) for w in range(8)}


def test_reader_skips_a_line_still_being_written(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"type": "event", "name": "a"}\nnot json\n[1]\n{"type": "event", "na')
    assert [r["name"] for r in read_jsonl(path)] == ["a"]
    with pytest.raises(ValueError, match="x.jsonl:2"):
        list(read_jsonl(path, strict=True))
    assert [r["name"] for r in read_jsonl(tmp_path, types={"event"})] == ["a"]


def test_default_layout_is_run_dir_telemetry_service(tmp_path: Path) -> None:
    config = TelemetryConfig(run_dir=tmp_path / "r")
    assert config.resolve_jsonl_path("dart-train", "r") == tmp_path / "r" / "telemetry" / "dart-train.jsonl"
    assert TelemetryConfig().resolve_jsonl_path("x", "abc") == Path("runs/abc/telemetry/x.jsonl")
    assert TelemetryConfig(jsonl_path=tmp_path / "f.jsonl").resolve_jsonl_path("x", "r") == tmp_path / "f.jsonl"


def test_a_shut_down_handle_writes_nothing_more(make_telemetry: MakeTelemetry) -> None:
    old = make_telemetry("svc")
    old.shutdown()
    new = make_telemetry("svc")  # shares the file, which is therefore still open
    old.event("late")
    ticks = iter(range(0, 1000, 10))
    tracker = old.busy_tracker("env", "env-0", clock=lambda: next(ticks))
    with tracker.busy("step"):
        pass
    new.shutdown()
    assert "late" not in [r["name"] for r in read_jsonl(new.jsonl_path, types={"event"})]
    assert list(read_jsonl(new.jsonl_path, types={"busy"})) == []
    assert tracker.intervals() != []  # in-memory accounting still works
