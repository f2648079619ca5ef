"""Creating and opening the run's topology that :mod:`dart.protocol.topology` declares: its streams, durable
consumers and state bucket on a JetStream server.

:func:`ensure_topology` creates them (a topology creator: ``dart run``'s supervisor, ``dart topology``, or a
connection without a user); :func:`open_topology` is what each service calls at start (a creator ensures, every
other role waits for a creator with :func:`await_topology` and only binds); :func:`missing_topology` says what
is not there yet; :func:`announced_version` reads a version the trainer announced from the ``model`` stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from dart.protocol.errors import JetStreamError
from dart.protocol.messages import ModelVersion
from dart.protocol.subjects import StreamKind
from dart.protocol.topology import BUCKETS, STATE_BUCKET, STREAMS, TOPOLOGY_CREATORS, TOPOLOGY_WAIT_S
from dart.runtime.bus import Bus, KeyValueStore

_TOPOLOGY_POLL_S = 0.5
"""How often a role that is no creator looks for the topology, seconds."""


def durable_name(bus: Bus, kind: StreamKind) -> str:
    """Durable consumer name of a stream's consumer group."""
    consumer = STREAMS[kind].consumer
    if consumer is None:
        raise ValueError(f"stream {kind!r} has no consumer group")
    return bus.subjects.consumer_name(kind, consumer.group)


async def ensure_topology(bus: Bus) -> KeyValueStore:
    """Create (or confirm) every stream, consumer and the state bucket; returns the state bucket."""
    for spec in STREAMS.values():
        await bus.ensure_stream(
            spec.kind,
            retention=spec.retention,  # type: ignore[arg-type]
            duplicate_window_s=spec.duplicate_window_s,
            max_age_s=spec.max_age_s,
            replicas=bus.config.replicas,
        )
        if spec.consumer is not None:
            await bus.ensure_consumer(
                spec.kind,
                durable_name(bus, spec.kind),
                ack_wait_s=spec.consumer.ack_wait_s,
                max_deliver=spec.consumer.max_deliver,
                max_ack_pending=spec.consumer.max_ack_pending,
                filter_subject=bus.subjects.stream_subject(spec.kind),
            )
    state = BUCKETS[STATE_BUCKET]
    return await bus.kv(bus.subjects.kv_bucket(state.name), history=state.history, replicas=bus.config.replicas)


async def open_topology(bus: Bus, *, wait_s: float = TOPOLOGY_WAIT_S) -> KeyValueStore:
    """What a service calls at start: :func:`ensure_topology` when its bus user is a topology creator,
    else :func:`await_topology`; returns the state bucket.

    Raises:
        JetStreamError: The topology could not be created, or was not there within ``wait_s``.
    """
    if bus.config.user in TOPOLOGY_CREATORS:
        return await ensure_topology(bus)
    return await await_topology(bus, wait_s=wait_s)


async def await_topology(bus: Bus, *, wait_s: float = TOPOLOGY_WAIT_S) -> KeyValueStore:
    """Wait until every stream, consumer and the state bucket exist, then bind to the bucket (creating,
    changing or checking settings is the creator's).

    Raises:
        JetStreamError: Something was still missing after ``wait_s`` (the message names it and who creates it).
    """
    deadline = time.monotonic() + wait_s
    while True:
        missing = await missing_topology(bus)
        if not missing:
            return await bus.kv(bus.subjects.kv_bucket(BUCKETS[STATE_BUCKET].name), create=False)
        if time.monotonic() >= deadline:
            raise JetStreamError(
                "await_topology",
                ", ".join(missing),
                f"not there after {wait_s:g} s: the run's streams, consumers and bucket are created by dart run, "
                "or in a deployment by `dart topology --config RUN_CONFIG` as the run user, before the services start",
            )
        await asyncio.sleep(_TOPOLOGY_POLL_S)


async def missing_topology(bus: Bus) -> list[str]:
    """Names of the run's streams, durable consumers and buckets that do not exist (or cannot be seen) now."""
    missing = []
    for spec in STREAMS.values():
        name = bus.subjects.stream_name(spec.kind)
        try:
            await bus.stream_state(spec.kind)
        except JetStreamError:
            missing.append(f"stream {name}")
            continue
        if spec.consumer is not None:
            try:
                await bus.consumer_state(spec.kind, durable_name(bus, spec.kind))
            except JetStreamError:
                missing.append(f"consumer {name}/{durable_name(bus, spec.kind)}")
    bucket = bus.subjects.kv_bucket(BUCKETS[STATE_BUCKET].name)
    try:
        await bus.kv(bucket, create=False)
    except JetStreamError:
        missing.append(f"bucket {bucket}")
    return missing


async def announced_version(bus: Bus, version: int) -> ModelVersion | None:
    """The :class:`ModelVersion` the trainer announced as ``version``, read from the ``model`` stream.

    Only the ``train`` role publishes there, so the record found (weights' and manifest's URIs and
    digests) is the trainer's own, whoever asks for the version. The stream is read from its newest
    message back; versions are announced in increasing order, so the search stops at the first older one.

    Returns:
        The announced record, or None when no version of that number was announced.

    Raises:
        JetStreamError: The stream could not be read.
    """
    async with contextlib.aclosing(bus.stored_messages("model", ModelVersion)) as stored:
        async for announced in stored:
            if announced.version <= version:
                return announced if announced.version == version else None
    return None
