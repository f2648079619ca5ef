"""The durable pipeline topology every service agrees on: streams, consumers and the state bucket.

This module is the declaration (the contract); :mod:`dart.runtime.topology` creates and opens it. The run's
streams, consumers and state bucket are created by :func:`~dart.runtime.topology.ensure_topology`, called by a
topology creator (:data:`TOPOLOGY_CREATORS`: ``dart run``'s supervisor before it starts the services,
``dart topology`` in a deployment, or any process on a server without per-role users). Each service
calls :func:`~dart.runtime.topology.open_topology` at start: a creator ensures the topology, every other role
waits until it exists (:func:`~dart.runtime.topology.await_topology`) and only binds to it, since its NATS
user may not create or change a stream or consumer (:mod:`dart.protocol.permissions`): no role can add a
subject it publishes on to a stream another role consumes. Each durable consumer also filters on its stream's
own subject. Because every stream and consumer has exactly one definition (here), concurrent calls are
idempotent instead of fighting over settings.

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
the trainer announced, in increasing order: :func:`~dart.runtime.topology.announced_version` looks one up by
number there (the rollout service, before it loads a version an evaluation asks for).

Who publishes and consumes what is recorded here too (``publishers``, ``consumers``, ``readers``,
``writers``): :func:`dart.protocol.permissions.service_permissions` derives each service's NATS
permissions from these tables, so a new stream or bucket is declared once. The request/reply endpoints
(env leases and calls, capabilities, evaluations) are declared the same way in
:data:`dart.protocol.endpoints.ENDPOINTS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
