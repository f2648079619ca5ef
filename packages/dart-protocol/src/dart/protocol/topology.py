"""The durable pipeline topology every service agrees on: streams, consumers and the state bucket.

Each service calls :func:`ensure_topology` at start. Because every stream and consumer has exactly
one definition (here), concurrent starts of several services are idempotent instead of fighting
over settings.

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
permissions from these tables, so a new stream or bucket is declared once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

from dart.protocol.bus import Bus, KeyValueStore
from dart.protocol.messages import ModelVersion
from dart.protocol.subjects import StreamKind

LATEST_MODEL_KEY = "model-latest"
"""Key of the newest ModelVersion in the ``state`` bucket."""
STATE_BUCKET = "state"

Role = Literal["env", "rollout", "data", "train", "run", "eval"]
"""A NATS identity: the four services, the ``dart run`` supervisor, and ``dart eval``."""
ROLES: tuple[Role, ...] = ("env", "rollout", "data", "train", "run", "eval")


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
    """Roles allowed to read stored messages by sequence (``Bus.largest_message``: the run summary's
    largest trajectory message; ``Bus.stored_messages``: the rollout service's look-up of announced
    versions)."""


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
            )
    state = BUCKETS[STATE_BUCKET]
    return await bus.kv(bus.subjects.kv_bucket(state.name), history=state.history, replicas=bus.config.replicas)


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
