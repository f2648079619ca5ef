"""Core request/reply, serving and connection behaviour of the bus, against a real nats-server."""

from __future__ import annotations

import asyncio
import base64
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Literal

import nats
import pytest
from pydantic import Field, TypeAdapter

from dart.embedded.nats import EmbeddedNats
from dart.protocol.errors import (
    BusConnectionError,
    ConfigError,
    MessageValidationError,
    NoRespondersError,
    PayloadTooLargeError,
    RemoteError,
    RequestTimeoutError,
    ServiceError,
    SubjectError,
)
from dart.protocol.messages.base import ErrorCode, ErrorReply, Message
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.ports import free_port

pytestmark = pytest.mark.integration


class Echo(Message):
    kind: Literal["echo"] = "echo"
    text: str
    delay_s: float = 0.0


class EchoReply(Message):
    kind: Literal["echo_reply"] = "echo_reply"
    text: str


class Other(Message):
    kind: Literal["other"] = "other"
    text: str


AnyReply = TypeAdapter(Annotated[EchoReply | Other, Field(discriminator="kind")])


def unique_run() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def config(nats_url: str) -> BusConfig:
    return BusConfig(url=nats_url, run=unique_run(), connect_timeout_s=2.0, request_timeout_s=2.0)


@pytest.fixture
async def bus(config: BusConfig) -> AsyncIterator[Bus]:
    async with await Bus.connect(config) as connected:
        yield connected


async def echo(req: Echo) -> EchoReply:
    if req.delay_s:
        await asyncio.sleep(req.delay_s)
    return EchoReply(text=req.text)


async def test_request_reply_round_trip_is_typed(bus: Bus) -> None:
    subject = bus.subjects.bench("echo")
    service = await bus.serve(subject, Echo, echo)

    reply = await bus.request(subject, Echo(text="hi"), EchoReply)

    assert reply == EchoReply(text="hi")
    assert service.stats.requests_served == 1
    assert bus.stats.requests_served == 1
    assert bus.stats.endpoint(subject).requests_served == 1


async def test_reply_type_may_be_a_union_adapter(bus: Bus) -> None:
    subject = bus.subjects.bench("echo")
    await bus.serve(subject, Echo, echo)

    reply = await bus.request(subject, Echo(text="u"), AnyReply)

    assert isinstance(reply, EchoReply) and reply.text == "u"


async def test_invalid_request_gets_typed_error_and_service_keeps_answering(bus: Bus, nats_url: str) -> None:
    subject = bus.subjects.bench("echo")
    await bus.serve(subject, Echo, echo)

    with pytest.raises(RemoteError) as wrong_kind:
        await bus.request(subject, Other(text="x"), EchoReply)
    assert wrong_kind.value.code == ErrorCode.INVALID_REQUEST
    assert wrong_kind.value.details["expected"] == "Echo"
    assert wrong_kind.value.details["errors"], "validation errors are passed to the caller"

    # Bytes no Bus would send: bad UTF-8, bad JSON, a right-looking body with an unknown field.
    raw = await nats.connect(nats_url)
    try:
        for payload in (b"\xff\xfe", b"{not json", b'{"kind":"echo","text":"a","extra":1}'):
            answer = await raw.request(subject, payload, timeout=2.0)
            error = ErrorReply.model_validate_json(answer.data)
            assert error.code == ErrorCode.INVALID_REQUEST
    finally:
        await raw.close()

    assert (await bus.request(subject, Echo(text="still here"), EchoReply)).text == "still here"
    assert bus.stats.invalid_requests == 4
    assert bus.stats.endpoint(subject).invalid_requests == 4
    assert bus.stats.requests_served == 1


async def test_handler_exception_is_answered_internal_and_counted(bus: Bus) -> None:
    subject = bus.subjects.bench("flaky")

    async def flaky(req: Echo) -> EchoReply:
        if req.text == "boom":
            raise RuntimeError("disk on fire")
        return EchoReply(text=req.text)

    await bus.serve(subject, Echo, flaky)

    with pytest.raises(RemoteError) as err:
        await bus.request(subject, Echo(text="boom"), EchoReply)
    assert err.value.code == ErrorCode.INTERNAL
    assert "disk on fire" in err.value.message
    assert (await bus.request(subject, Echo(text="ok"), EchoReply)).text == "ok"
    assert bus.stats.handler_errors == 1
    assert bus.stats.requests_served == 1


async def test_service_error_becomes_remote_error_with_its_code(bus: Bus) -> None:
    subject = bus.subjects.bench("lookup")

    async def lookup(req: Echo) -> EchoReply:
        raise ServiceError(ErrorCode.NOT_FOUND, f"no lease {req.text}", {"lease_id": req.text}, retryable=False)

    await bus.serve(subject, Echo, lookup)

    with pytest.raises(RemoteError) as err:
        await bus.request(subject, Echo(text="L1"), EchoReply)
    assert (err.value.code, err.value.details) == (ErrorCode.NOT_FOUND, {"lease_id": "L1"})
    assert bus.stats.error_replies == 1
    assert bus.stats.handler_errors == 0


async def test_handler_returning_a_non_message_is_an_internal_error(bus: Bus) -> None:
    subject = bus.subjects.bench("sloppy")

    async def sloppy(req: Echo) -> EchoReply:
        return {"text": req.text}  # type: ignore[return-value]  # the bug under test

    await bus.serve(subject, Echo, sloppy)
    with pytest.raises(RemoteError) as err:
        await bus.request(subject, Echo(text="x"), EchoReply)
    assert err.value.code == ErrorCode.INTERNAL


async def test_undecodable_reply_raises_message_validation_error(bus: Bus) -> None:
    subject = bus.subjects.bench("echo")
    await bus.serve(subject, Echo, echo)

    with pytest.raises(MessageValidationError) as err:
        await bus.request(subject, Echo(text="x"), Other)
    assert err.value.expected == "Other"


async def test_request_times_out(bus: Bus) -> None:
    subject = bus.subjects.bench("slow")
    await bus.serve(subject, Echo, echo)

    started = time.monotonic()
    with pytest.raises(RequestTimeoutError) as err:
        await bus.request(subject, Echo(text="zzz", delay_s=2.0), EchoReply, timeout=0.2)
    assert err.value.subject == subject
    assert time.monotonic() - started < 1.0


async def test_request_without_responders_fails_fast(bus: Bus) -> None:
    started = time.monotonic()
    with pytest.raises(NoRespondersError):
        await bus.request(bus.subjects.bench("nobody"), Echo(text="?"), EchoReply, timeout=2.0)
    assert time.monotonic() - started < 1.0


async def test_connect_to_closed_port_fails_fast_naming_the_url() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BusConnectionError) as err:
        await Bus.connect(BusConfig(url=url, connect_timeout_s=0.5, reconnect_wait_s=0.1))
    assert time.monotonic() - started < 2.0
    assert url in str(err.value)
    assert err.value.servers == [url]


async def test_oversized_messages_fail_with_a_typed_error_on_both_sides(bus: Bus, nats_server: EmbeddedNats) -> None:
    subject = bus.subjects.bench("big")
    too_big = base64.b64encode(os.urandom(nats_server.max_payload + 4096)).decode()  # beyond it even compressed

    async def inflate(req: Echo) -> EchoReply:
        return EchoReply(text=too_big if req.text == "inflate" else req.text)

    await bus.serve(subject, Echo, inflate)

    with pytest.raises(PayloadTooLargeError) as sent:
        await bus.request(subject, Echo(text=too_big), EchoReply)
    assert sent.value.limit == nats_server.max_payload
    with pytest.raises(RemoteError, match="bus limit") as answered:
        # The service finds its reply too large once it has encoded it: compressing megabytes that do not
        # compress takes seconds on a busy machine, beyond the default request timeout.
        await bus.request(subject, Echo(text="inflate"), EchoReply, timeout=60.0)
    assert answered.value.code == ErrorCode.INTERNAL
    assert (await bus.request(subject, Echo(text="small"), EchoReply)).text == "small"


async def test_the_configured_message_limit_is_enforced_on_every_send(config: BusConfig) -> None:
    limited = config.model_copy(update={"max_message_bytes": 4096})
    async with await Bus.connect(limited) as bus:
        subject = bus.subjects.bench("limited")

        async def inflate(req: Echo) -> EchoReply:
            return EchoReply(text="y" * 5000 if req.text == "inflate" else req.text)

        await bus.serve(subject, Echo, inflate)
        # Far below the server's max_payload: the bus's own limit refuses it, naming subject and size.
        with pytest.raises(PayloadTooLargeError, match=r"message of \d+ bytes on '.*limited'") as sent:
            await bus.request(subject, Echo(text="x" * 5000), EchoReply)
        assert (sent.value.subject, sent.value.limit) == (subject, 4096)
        assert sent.value.size > 5000
        with pytest.raises(PayloadTooLargeError):
            await bus.publish(subject, Echo(text="x" * 5000))
        await bus.ensure_stream("work")
        with pytest.raises(PayloadTooLargeError):
            await bus.js_publish(bus.subjects.stream_subject("work"), Echo(text="x" * 5000), msg_id="big")
        with pytest.raises(RemoteError, match="bus limit of 4096 bytes") as answered:
            await bus.request(subject, Echo(text="inflate"), EchoReply)
        assert answered.value.code == ErrorCode.INTERNAL
        assert (await bus.request(subject, Echo(text="small"), EchoReply)).text == "small"


async def test_a_limit_above_the_servers_max_payload_is_refused_at_connect(
    config: BusConfig, nats_server: EmbeddedNats
) -> None:
    with pytest.raises(ConfigError, match=r"bus.max_message_bytes.*max_payload"):
        await Bus.connect(config.model_copy(update={"max_message_bytes": nats_server.max_payload + 1}))


async def test_bad_subject_and_closed_bus_fail_with_typed_errors(config: BusConfig) -> None:
    bus = await Bus.connect(config)
    with pytest.raises(SubjectError):
        await bus.publish("bad subject", Echo(text="x"))
    await bus.close()
    with pytest.raises(BusConnectionError):
        await bus.request(bus.subjects.bench("echo"), Echo(text="x"), EchoReply)
    with pytest.raises(BusConnectionError):
        await bus.publish(bus.subjects.bench("echo"), Echo(text="x"))


async def test_handlers_run_concurrently_up_to_the_bound(bus: Bus) -> None:
    subject = bus.subjects.bench("concurrent")
    running = 0
    peak = 0

    async def slow(req: Echo) -> EchoReply:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.2)
        running -= 1
        return EchoReply(text=req.text)

    await bus.serve(subject, Echo, slow, max_concurrency=4)

    replies = await asyncio.gather(*(bus.request(subject, Echo(text=str(i)), EchoReply) for i in range(8)))

    assert sorted(r.text for r in replies) == sorted(str(i) for i in range(8))
    # Concurrent (more than one at a time), and never more than the bound: counted, not timed.
    assert peak == 4


async def test_queue_group_members_share_requests(config: BusConfig) -> None:
    subject = config.subjects().bench("shared")
    seen: dict[str, int] = {"a": 0, "b": 0}

    def member(name: str) -> Callable[[Echo], Awaitable[EchoReply]]:
        async def handle(req: Echo) -> EchoReply:
            seen[name] += 1
            return EchoReply(text=name)

        return handle

    async with await Bus.connect(config) as a, await Bus.connect(config) as b:
        await a.serve(subject, Echo, member("a"), queue="workers")
        await b.serve(subject, Echo, member("b"), queue="workers")
        for _ in range(40):
            await a.request(subject, Echo(text="x"), EchoReply)
    assert seen["a"] + seen["b"] == 40
    assert seen["a"] > 0 and seen["b"] > 0


async def test_publish_reaches_subscribers(bus: Bus) -> None:
    subject = bus.subjects.bench("events")
    received: asyncio.Queue[Echo] = asyncio.Queue()

    async def on_event(msg: Echo) -> None:
        await received.put(msg)

    await bus.subscribe(subject, Echo, on_event)
    await bus.publish(subject, Echo(text="e1"))
    await bus.publish(subject, Other(text="not an echo"))  # counted, skipped
    await bus.publish(subject, Echo(text="e2"))

    got = [await asyncio.wait_for(received.get(), 2.0) for _ in range(2)]
    assert [m.text for m in got] == ["e1", "e2"]
    assert bus.stats.invalid_requests == 1


async def test_stopped_service_no_longer_answers(bus: Bus) -> None:
    subject = bus.subjects.bench("echo")
    service = await bus.serve(subject, Echo, echo)
    await service.stop()
    await service.stop()  # idempotent
    with pytest.raises(NoRespondersError):
        await bus.request(subject, Echo(text="x"), EchoReply)


async def test_drain_lets_in_flight_handlers_answer(config: BusConfig) -> None:
    subject = config.subjects().bench("drain")
    server = await Bus.connect(config)
    client = await Bus.connect(config)
    try:
        await server.serve(subject, Echo, echo)
        pending = asyncio.create_task(client.request(subject, Echo(text="late", delay_s=0.3), EchoReply))
        await asyncio.sleep(0.1)  # the handler is running
        await server.drain()
        assert (await pending).text == "late"
        assert not server.is_connected
    finally:
        await client.close()
        await server.close()


async def test_bus_reconnects_after_server_restart() -> None:
    server = EmbeddedNats(jetstream=False).start()
    try:
        config = BusConfig(url=server.url, run=unique_run(), reconnect_wait_s=0.1, request_timeout_s=2.0)
        async with await Bus.connect(config) as bus:
            subject = bus.subjects.bench("echo")
            await bus.serve(subject, Echo, echo)
            assert (await bus.request(subject, Echo(text="before"), EchoReply)).text == "before"

            server.stop()
            server.start()
            for _ in range(200):  # up to 10 s
                if bus.stats.reconnects:
                    break
                await asyncio.sleep(0.05)
            assert bus.is_connected
            assert bus.stats.disconnects >= 1
            # Subscriptions are replayed on reconnect: the same service answers again.
            assert (await bus.request(subject, Echo(text="after"), EchoReply)).text == "after"
    finally:
        server.stop()
