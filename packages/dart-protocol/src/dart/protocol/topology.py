"""The durable pipeline topology every service agrees on: streams, consumers and the state bucket.

The run's streams, consumers and state bucket are created by :func:`ensure_topology`, called by a
topology creator (:data:`TOPOLOGY_CREATORS`: ``dart run``'s supervisor before it starts the services,
``dart topology`` in a deployment, or any process on a server without per-role users). Each service
calls :func:`open_topology` at start: a creator ensures the topology, every other role waits until it
exists (:func:`await_topology`) and only binds to it, since its NATS user may not create or change a
stream or consumer (:mod:`dart.protocol.permissions`): no role can add a subject it publishes on to a
stream another role consumes. Each durable consumer also filters on its stream's own subject. Because
every stream and consumer has exactly one definition (here), concurrent calls are idempotent instead of
fighting over settings.

=========  ================  ===============  ====================  ===========================
stream     message           published by     consumed by (durable) dedupe id
=========  ================  ===============  ====================  ===========================
``work``   WorkItem          dart-data        dart-rollout runners  ``work_id``
``traj``   Trajectory        dart-rollout     dart-data ingest      ``trajectory_id``
``batch``  TrainingBatch     dart-data        dart-train            ``batch_id``
``model``  ModelVersion      dart-train       (history, audit)      ``model-v<version>``
=========  ================  ===============  ====================  ===========================

The ``state`` KV bucket holds the latest :class:`ModelVersion` under :data:`LATEST_MODEL_KEY`;
engines' sync controllers and the data manager watch it. The ``model`` stream keeps every version
the trainer announced, in increasing order: :func:`announced_version` looks one up by number there
(the rollout service, before it loads a version an evaluation asks for).

Who publishes and consumes what is recorded here too (``publishers``, ``consumers``, ``readers``,
``writers``): :func:`dart.protocol.permissions.service_permissions` derives each service's NATS
permissions from these tables, so a new stream or bucket is declared once. The request/reply endpoints
(env leases and calls, capabilities, evaluations) are declared the same way in
:data:`dart.protocol.endpoints.ENDPOINTS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Literal

from dart.protocol.bus import Bus, KeyValueStore
from dart.protocol.errors import JetStreamError
from dart.protocol.messages import ModelVersion
from dart.protocol.subjects import StreamKind

LATEST_MODEL_KEY = "model-latest"
"""Key of the newest ModelVersion in the ``state`` bucket."""
STATE_BUCKET = "state"

Role = Literal["env", "rollout", "data", "train", "run", "eval"]
"""A NATS identity: the four services, the ``dart run`` supervisor, and ``dart eval``."""
ROLES: tuple[Role, ...] = ("env", "rollout", "data", "train", "run", "eval")

TOPOLOGY_CREATORS: frozenset[str | None] = frozenset({None, "run"})
"""Bus users that create and update the run's streams, consumers and bucket: the ``run`` role and a
connection without a user (a server without per-role users). The other roles only bind to them."""

TOPOLOGY_WAIT_S = 120.0
"""How long a service waits at start for a creator to make the run's topology, seconds."""

_TOPOLOGY_POLL_S = 0.5


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer of one stream.

    Attributes:
        group: Consumer group token (``subjects.consumer_name(stream, group)``).
        ack_wait_s: Seconds before an unacked delivery is redelivered; long-running holders send
            ``in_progress`` heartbeats within it.
        max_deliver: Deliveries before the server gives up on a message.
        max_ack_pending: Deliveries outstanding at once: a natural backpressure bound.
    """

    group: str
    ack_wait_s: float
    max_deliver: int
    max_ack_pending: int = 1000
    consumers: tuple[Role, ...] = ()
    """Roles that pull (and ack) from this consumer."""


@dataclass(frozen=True)
class StreamSpec:
    """One pipeline stream and its consumer."""

    kind: StreamKind
    retention: str
    consumer: ConsumerSpec | None
    duplicate_window_s: float = 600.0
    max_age_s: float | None = None
    publishers: tuple[Role, ...] = ()
    """Roles allowed to publish to the stream's subject."""
    message_readers: tuple[Role, ...] = ()
    """Roles allowed to read stored messages by sequence (``Bus.census``: the run summary's count of
    distinct and replayed trajectories and its largest trajectory message; ``Bus.stored_messages``: the
    rollout service's look-up of announced versions)."""


@dataclass(frozen=True)
class BucketSpec:
    """A KV bucket of the run.

    Attributes:
        name: Bucket token (``subjects.kv_bucket(name)``).
        history: Revisions kept per key.
        writers: Roles that put values.
        readers: Roles that get or watch values.
    """

    name: str
    history: int
    writers: tuple[Role, ...]
    readers: tuple[Role, ...]


STREAMS: dict[StreamKind, StreamSpec] = {
    # Work items are deleted once a runner acks them (work queue).
    "work": StreamSpec(
        "work",
        "workqueue",
        ConsumerSpec("runners", ack_wait_s=60.0, max_deliver=3, consumers=("rollout",)),
        publishers=("data",),
    ),
    "traj": StreamSpec(
        "traj",
        "limits",
        ConsumerSpec("data", ack_wait_s=60.0, max_deliver=10, consumers=("data",)),
        publishers=("rollout",),
        message_readers=("run",),
    ),
    "batch": StreamSpec(
        "batch",
        "limits",
        ConsumerSpec("trainer", ack_wait_s=300.0, max_deliver=5, consumers=("train",)),
        publishers=("data",),
    ),
    "model": StreamSpec("model", "limits", None, publishers=("train",), message_readers=("rollout",)),
}

BUCKETS: dict[str, BucketSpec] = {
    STATE_BUCKET: BucketSpec(
        STATE_BUCKET, history=8, writers=("train",), readers=("rollout", "data", "train", "run", "eval")
    ),
}


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
