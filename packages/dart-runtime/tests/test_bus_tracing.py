"""W3C trace context crosses the bus: the receiver's span is a child of the sender's.

The spans are recorded by an in-memory exporter on a tracer provider handed to the bus, not on the
process-global provider: OpenTelemetry allows one global provider per process, and DART's telemetry
setup owns it (it installs a router there), so a test that claimed it would break the telemetry
tests that run after it. Propagation itself goes through the global W3C propagator, as in services.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Literal

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from dart.protocol.messages.base import Message
from dart.runtime.bus import Bus, BusConfig

pytestmark = pytest.mark.integration


class Ping(Message):
    kind: Literal["ping"] = "ping"
    text: str


class Pong(Message):
    kind: Literal["pong"] = "pong"
    trace_id: int
    span_id: int


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    yield spans
    spans.shutdown()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield tracer_provider
    tracer_provider.shutdown()


@pytest.fixture
async def bus(nats_url: str, provider: TracerProvider) -> AsyncIterator[Bus]:
    config = BusConfig(url=nats_url, run=f"t{uuid.uuid4().hex[:12]}", request_timeout_s=2.0)
    async with await Bus.connect(config, tracer_provider=provider) as connected:
        yield connected


async def finished_span(exporter: InMemorySpanExporter, kind: SpanKind, timeout_s: float = 2.0) -> ReadableSpan:
    """The one finished span of ``kind``; receivers may end theirs just after the sender returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.kind == kind]
        if spans or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    assert len(spans) == 1, f"expected one {kind} span, got {[s.name for s in exporter.get_finished_spans()]}"
    return spans[0]


def assert_child(child: ReadableSpan, parent: ReadableSpan) -> None:
    assert child.parent is not None, f"{child.name} has no parent"
    assert parent.context is not None and child.context is not None
    assert child.context.trace_id == parent.context.trace_id
    assert child.parent.span_id == parent.context.span_id
    assert child.parent.is_remote, "the link must come from the message headers, not the local context"


async def test_served_request_runs_in_a_server_span_child_of_the_client_span(
    bus: Bus, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    subject = bus.subjects.bench("ping")

    async def handle(req: Ping) -> Pong:
        current = trace.get_current_span().get_span_context()
        return Pong(trace_id=current.trace_id, span_id=current.span_id)

    await bus.serve(subject, Ping, handle)
    with provider.get_tracer("test").start_as_current_span("caller") as caller:
        pong = await bus.request(subject, Ping(text="hi"), Pong)

    client = await finished_span(exporter, SpanKind.CLIENT)
    server = await finished_span(exporter, SpanKind.SERVER)
    assert client.parent is not None and client.parent.span_id == caller.get_span_context().span_id
    assert_child(server, client)
    assert server.context is not None
    assert (pong.trace_id, pong.span_id) == (server.context.trace_id, server.context.span_id), (
        "the handler runs inside the server span"
    )
    assert server.attributes is not None and server.attributes["messaging.destination.name"] == subject


async def test_jetstream_consumer_span_is_child_of_the_producer_span(
    bus: Bus, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    durable = bus.subjects.consumer_name("traj", "ingest")
    await bus.ensure_stream("traj")
    await bus.ensure_consumer("traj", durable)
    with provider.get_tracer("test").start_as_current_span("rollout"):
        await bus.js_publish(bus.subjects.stream_subject("traj"), Ping(text="t1"), msg_id="t1")

    consumer = await bus.pull_consumer("traj", durable, Ping)
    [delivery] = await consumer.fetch(1, timeout=2.0)
    assert "traceparent" in {key.lower() for key in delivery.headers}
    with delivery.span() as span:
        inside = trace.get_current_span()
        await delivery.ack()

    producer = await finished_span(exporter, SpanKind.PRODUCER)
    consumer_span = await finished_span(exporter, SpanKind.CONSUMER)
    assert_child(consumer_span, producer)
    assert inside is span
    assert consumer_span.attributes is not None and consumer_span.attributes["messaging.message.delivery_count"] == 1


async def test_core_publish_carries_context_to_subscribers(
    bus: Bus, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    subject = bus.subjects.bench("announce")
    seen: asyncio.Queue[int] = asyncio.Queue()

    async def on_ping(msg: Ping) -> None:
        await seen.put(trace.get_current_span().get_span_context().trace_id)

    await bus.subscribe(subject, Ping, on_ping)
    with provider.get_tracer("test").start_as_current_span("announcer") as announcer:
        await bus.publish(subject, Ping(text="v2"))

    assert await asyncio.wait_for(seen.get(), 2.0) == announcer.get_span_context().trace_id
    assert_child(await finished_span(exporter, SpanKind.CONSUMER), await finished_span(exporter, SpanKind.PRODUCER))
