"""JetStream streams, durable pull consumers and KV buckets of the bus, against a real nats-server."""

from __future__ import annotations

import asyncio
import base64
import os
import uuid
from collections.abc import AsyncIterator
from typing import Literal

import nats
import nats.aio.msg
import pytest

from dart.embedded.nats import EmbeddedNats
from dart.protocol.errors import JetStreamError, MessageValidationError, PayloadTooLargeError, RevisionConflictError
from dart.protocol.messages.base import Message
from dart.runtime.bus import Bus, BusConfig

pytestmark = pytest.mark.integration


class Work(Message):
    kind: Literal["work"] = "work"
    item_id: str


class State(Message):
    kind: Literal["state"] = "state"
    version: int


@pytest.fixture
def config(nats_url: str) -> BusConfig:
    return BusConfig(url=nats_url, run=f"t{uuid.uuid4().hex[:12]}", connect_timeout_s=2.0, request_timeout_s=2.0)


@pytest.fixture
async def bus(config: BusConfig) -> AsyncIterator[Bus]:
    async with await Bus.connect(config) as connected:
        yield connected


async def work_queue(bus: Bus, *, ack_wait_s: float = 30.0, max_deliver: int = 5) -> str:
    """Create the run's work stream and its runners consumer; return the durable name."""
    durable = bus.subjects.consumer_name("work", "runners")
    await bus.ensure_stream("work")
    await bus.ensure_consumer("work", durable, ack_wait_s=ack_wait_s, max_deliver=max_deliver)
    return durable


async def test_ensure_stream_is_idempotent_and_updates_changed_config(bus: Bus) -> None:
    assert await bus.ensure_stream("work", max_age_s=3600) == "created"
    assert await bus.ensure_stream("work", max_age_s=3600) == "unchanged"
    assert await bus.ensure_stream("work", max_age_s=7200, duplicate_window_s=60) == "updated"
    assert await bus.ensure_stream("work", max_age_s=7200, duplicate_window_s=60) == "unchanged"
    assert (await bus.stream_state("work")).messages == 0
    # A max age under the default 2 min duplicate window shrinks the window instead of failing.
    assert await bus.ensure_stream("model", max_age_s=30) == "created"
    assert await bus.ensure_stream("model", max_age_s=30) == "unchanged"


async def test_ensure_stream_refuses_an_immutable_change(bus: Bus) -> None:
    await bus.ensure_stream("traj", storage="file")
    with pytest.raises(JetStreamError) as err:
        await bus.ensure_stream("traj", storage="memory")
    assert err.value.target == bus.subjects.stream_name("traj")


async def test_ensure_stream_by_name_needs_subjects(bus: Bus) -> None:
    with pytest.raises(ValueError, match="subjects"):
        await bus.ensure_stream("CUSTOM")
    name = bus.subjects.stream_name("batch") + "_CUSTOM"
    assert await bus.ensure_stream(name, [bus.subjects.stream_subject("batch")], storage="memory") == "created"


async def test_ensure_consumer_is_idempotent(bus: Bus) -> None:
    durable = bus.subjects.consumer_name("work", "runners")
    await bus.ensure_stream("work")
    assert await bus.ensure_consumer("work", durable, ack_wait_s=5, max_deliver=3) == "created"
    assert await bus.ensure_consumer("work", durable, ack_wait_s=5, max_deliver=3) == "unchanged"
    assert await bus.ensure_consumer("work", durable, ack_wait_s=10, max_deliver=3) == "updated"


async def test_js_publish_deduplicates_by_msg_id(bus: Bus) -> None:
    await bus.ensure_stream("work")
    subject = bus.subjects.stream_subject("work")

    first = await bus.js_publish(subject, Work(item_id="w1"), msg_id="w1")
    again = await bus.js_publish(subject, Work(item_id="w1"), msg_id="w1")
    other = await bus.js_publish(subject, Work(item_id="w2"), msg_id="w2")

    assert not first.duplicate and again.duplicate
    assert again.seq == first.seq
    assert other.seq == first.seq + 1
    assert (await bus.stream_state("work")).messages == 2


async def test_js_publish_without_stream_fails_clearly(bus: Bus) -> None:
    with pytest.raises(JetStreamError, match="ensure_stream"):
        await bus.js_publish(bus.subjects.stream_subject("model"), Work(item_id="x"), msg_id="x", timeout=1.0)


async def test_js_publish_of_an_oversized_message_fails_typed(bus: Bus, nats_server: EmbeddedNats) -> None:
    await bus.ensure_stream("work")
    with pytest.raises(PayloadTooLargeError):
        big = Work(item_id=base64.b64encode(os.urandom(nats_server.max_payload + 4096)).decode())  # even compressed
        await bus.js_publish(bus.subjects.stream_subject("work"), big, msg_id="big")


async def test_fetch_decodes_and_ack_settles(bus: Bus) -> None:
    durable = await work_queue(bus)
    await bus.js_publish(bus.subjects.stream_subject("work"), Work(item_id="a"), msg_id="a")
    consumer = await bus.pull_consumer("work", durable, Work)

    [delivery] = await consumer.fetch(1, timeout=2.0)
    assert delivery.message == Work(item_id="a")
    assert (delivery.num_delivered, delivery.msg_id, delivery.stream_seq) == (1, "a", 1)
    await delivery.ack()

    assert await consumer.fetch(1, timeout=0.3) == []
    state = await bus.consumer_state("work", durable)
    assert (state.num_pending, state.num_ack_pending) == (0, 0)


async def test_unacked_message_of_a_dead_consumer_is_redelivered_to_another(config: BusConfig) -> None:
    async with await Bus.connect(config) as setup:
        durable = await work_queue(setup, ack_wait_s=1.0)
        await setup.js_publish(setup.subjects.stream_subject("work"), Work(item_id="job"), msg_id="job")

    doomed = await Bus.connect(config)
    [taken] = await (await doomed.pull_consumer("work", durable, Work)).fetch(1, timeout=2.0)
    assert taken.num_delivered == 1
    await doomed.close()  # dies holding the message, without ack

    async with await Bus.connect(config) as survivor:
        consumer = await survivor.pull_consumer("work", durable, Work)
        [again] = await consumer.fetch(1, timeout=3.0)
        assert again.message == Work(item_id="job")
        assert again.num_delivered == 2
        await again.ack()


async def test_nak_redelivers_and_term_does_not(bus: Bus) -> None:
    durable = await work_queue(bus)
    subject = bus.subjects.stream_subject("work")
    await bus.js_publish(subject, Work(item_id="retry"), msg_id="retry")
    consumer = await bus.pull_consumer("work", durable, Work)

    [first] = await consumer.fetch(1, timeout=2.0)
    await first.nak()
    [second] = await consumer.fetch(1, timeout=2.0)
    assert (second.message.item_id, second.num_delivered) == ("retry", 2)
    await second.nak(delay=0.3)
    assert await consumer.fetch(1, timeout=0.1) == []  # still delayed
    [third] = await consumer.fetch(1, timeout=2.0)
    assert third.num_delivered == 3
    await third.term()
    assert await consumer.fetch(1, timeout=0.5) == []


async def test_in_progress_keeps_a_long_job_from_redelivery(bus: Bus) -> None:
    durable = await work_queue(bus, ack_wait_s=1.0)
    await bus.js_publish(bus.subjects.stream_subject("work"), Work(item_id="long"), msg_id="long")
    consumer = await bus.pull_consumer("work", durable, Work)
    rival = await bus.pull_consumer("work", durable, Work)

    [job] = await consumer.fetch(1, timeout=2.0)
    for _ in range(4):  # 1.6 s of work, longer than ack_wait
        await asyncio.sleep(0.4)
        await job.in_progress()
    assert await rival.fetch(1, timeout=0.2) == []
    await job.ack()


async def test_poison_message_is_terminated_and_counted(bus: Bus, nats_url: str) -> None:
    durable = await work_queue(bus, ack_wait_s=1.0)
    subject = bus.subjects.stream_subject("work")
    raw = await nats.connect(nats_url)
    try:
        await raw.jetstream().publish(subject, b"\x00 not a message")
    finally:
        await raw.close()
    await bus.js_publish(subject, Work(item_id="good"), msg_id="good")
    consumer = await bus.pull_consumer("work", durable, Work)

    deliveries = []
    for _ in range(3):  # the poison is dropped from a batch, so a batch may come back empty
        deliveries += await consumer.fetch(2, timeout=1.0)
        if deliveries:
            break
    assert [d.message.item_id for d in deliveries] == ["good"]
    await deliveries[0].ack()
    assert bus.stats.poison_total == 1
    assert consumer.poisoned == 1

    await asyncio.sleep(1.2)  # past ack_wait: a non-terminated message would come back now
    assert await consumer.fetch(1, timeout=0.5) == []
    assert (await bus.consumer_state("work", durable)).num_ack_pending == 0
    assert bus.stats.poison_total == 1


async def test_messages_iterates_across_fetches(bus: Bus) -> None:
    durable = await work_queue(bus)
    subject = bus.subjects.stream_subject("work")
    for i in range(5):
        await bus.js_publish(subject, Work(item_id=f"w{i}"), msg_id=f"w{i}")
    consumer = await bus.pull_consumer("work", durable, Work)

    seen = []
    async for delivery in consumer.messages(batch=2, timeout=1.0):
        seen.append(delivery.message.item_id)
        await delivery.ack()
        if len(seen) == 5:
            await consumer.close()
    assert seen == [f"w{i}" for i in range(5)]


async def test_closing_mid_batch_hands_the_rest_back_at_once(bus: Bus) -> None:
    durable = await work_queue(bus, ack_wait_s=30.0)
    subject = bus.subjects.stream_subject("work")
    for i in range(3):
        await bus.js_publish(subject, Work(item_id=f"w{i}"), msg_id=f"w{i}")
    consumer = await bus.pull_consumer("work", durable, Work)

    async for delivery in consumer.messages(batch=3, timeout=1.0):
        await delivery.ack()
        await consumer.close()

    other = await bus.pull_consumer("work", durable, Work)
    rest = await other.fetch(2, timeout=1.0)  # well before the 30 s ack_wait
    assert sorted(d.message.item_id for d in rest) == ["w1", "w2"]
    assert all(d.num_delivered == 2 for d in rest)


@pytest.mark.parametrize("batch", [1, 4])
async def test_a_cancellation_that_comes_with_a_message_ends_the_fetch(bus: Bus, batch: int) -> None:
    """nats-py's fetch waits with asyncio.wait_for, which on Python 3.11 returns a message that arrives in
    the same loop pass as a cancellation instead of raising it (a data manager's ingest loop never
    stopped that way). The consumer raises the cancellation anyway and hands the message back at once."""
    durable = await work_queue(bus, ack_wait_s=30.0)
    consumer = await bus.pull_consumer("work", durable, Work)
    fetching = asyncio.create_task(consumer.fetch(batch, timeout=10.0))
    # The moment of the race, made certain: the fetch is cancelled as nats-py queues the message for it.
    queue = consumer._sub._sub._pending_queue  # nats-py's queue of the pull subscription
    put = queue.put_nowait

    def put_then_cancel(msg: nats.aio.msg.Msg) -> None:
        put(msg)
        if msg.data and not (msg.headers or {}).get("Status"):
            fetching.cancel()

    queue.put_nowait = put_then_cancel  # type: ignore[method-assign]
    await asyncio.sleep(0.2)  # the pull request is out
    await bus.js_publish(bus.subjects.stream_subject("work"), Work(item_id="raced"), msg_id="raced")
    with pytest.raises(asyncio.CancelledError):
        await fetching
    queue.put_nowait = put  # type: ignore[method-assign]

    [again] = await consumer.fetch(1, timeout=2.0)  # well before the 30 s ack_wait
    assert (again.message.item_id, again.num_delivered) == ("raced", 2)


async def test_pull_consumer_requires_an_existing_durable(bus: Bus) -> None:
    await bus.ensure_stream("work")
    with pytest.raises(JetStreamError, match="ensure_consumer"):
        await bus.pull_consumer("work", bus.subjects.consumer_name("work", "ghosts"), Work)


async def test_kv_typed_put_get_and_compare_and_set(bus: Bus) -> None:
    bucket = bus.subjects.kv_bucket("state")
    kv = await bus.kv(bucket, history=5)
    assert (await bus.kv(bucket, history=5)).bucket == bucket  # idempotent bind

    assert await kv.get("latest", State) is None
    first = await kv.put("latest", State(version=1))
    assert await kv.get("latest", State) == State(version=1)
    assert await kv.get_raw("latest") == State(version=1).model_dump_json().encode()

    entry = await kv.get_entry("latest", State)
    assert entry is not None and entry.revision == first
    second = await kv.update("latest", State(version=2), revision=first)
    with pytest.raises(RevisionConflictError):
        await kv.update("latest", State(version=3), revision=first)  # lost the race
    with pytest.raises(RevisionConflictError):
        await kv.create("latest", State(version=9))
    assert await kv.get("latest", State) == State(version=2)
    assert second > first

    await kv.put_raw("junk", b"{}")
    with pytest.raises(MessageValidationError):
        await kv.get("junk", State)
    assert sorted(await kv.keys()) == ["junk", "latest"]
    await kv.delete("junk")
    assert await kv.get("junk", State) is None
    assert await kv.keys() == ["latest"]


async def test_kv_watch_sees_current_value_then_updates(bus: Bus) -> None:
    kv = await bus.kv(bus.subjects.kv_bucket("state"))
    await kv.put("latest", State(version=1))

    async def collect() -> list[tuple[str, int | None]]:
        seen: list[tuple[str, int | None]] = []
        async for entry in kv.watch(State, "latest"):
            seen.append((entry.operation, entry.value.version if entry.value else None))
            if len(seen) == 3:
                break
        return seen

    watcher = asyncio.create_task(collect())
    await asyncio.sleep(0.2)
    await kv.put("latest", State(version=2))
    await kv.delete("latest")
    assert await asyncio.wait_for(watcher, 3.0) == [("put", 1), ("put", 2), ("delete", None)]


async def test_kv_reopen_with_other_history_updates_the_bucket(bus: Bus) -> None:
    bucket = bus.subjects.kv_bucket("versions")
    kv = await bus.kv(bucket, history=1)
    for version in range(3):
        await kv.put("latest", State(version=version))
    kv = await bus.kv(bucket, history=4)
    for version in range(3, 6):
        await kv.put("latest", State(version=version))
    history = await kv.history("latest", State)
    assert [entry.value.version for entry in history if entry.value] == [2, 3, 4, 5]
    assert await kv.history("never-written", State) == []


async def test_census_counts_messages_sizes_and_replays(bus: Bus) -> None:
    from dart.protocol.messages.codec import encode

    await bus.ensure_stream("work")
    empty = await bus.census("work", "item_id")
    assert (empty.messages, empty.largest_bytes, empty.distinct, empty.duplicates) == (0, 0, 0, 0)
    small, big = Work(item_id="s"), Work(item_id="b" * 5000)
    for i, msg in enumerate((small, big, small)):  # the second "s" under another message id: a replay
        await bus.js_publish(bus.subjects.stream_subject("work"), msg, msg_id=f"m{i}")
    census = await bus.census("work", "item_id")
    assert (census.messages, census.largest_bytes) == (3, len(encode(big)))
    assert (census.distinct, census.duplicates) == (2, 1)
    huge = Work(item_id="h" * 200_000)  # travels compressed: counted by its bytes on the bus, read by its id
    for msg_id in ("m3", "m4"):  # and replayed once
        await bus.js_publish(bus.subjects.stream_subject("work"), huge, msg_id=msg_id)
    census = await bus.census("work", "item_id")
    assert len(encode(huge)) < len(encode(big))
    assert (census.messages, census.largest_bytes) == (5, len(encode(big)))
    assert (census.distinct, census.duplicates) == (3, 2)
