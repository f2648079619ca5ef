"""Per-service NATS permissions, derived from the subjects, the topology and the endpoints.

Each DART process connects as one role (:data:`~dart.protocol.topology.Role`): ``env``, ``rollout``,
``data``, ``train``, the ``dart run`` supervisor (``run``) or ``dart eval`` (``eval``). What a role
may publish and subscribe to follows from :mod:`dart.protocol.subjects` (the names),
:mod:`dart.protocol.topology` (who publishes, consumes, reads and writes each stream and bucket) and
:mod:`dart.protocol.endpoints` (who serves and who calls each request/reply endpoint), never from a
second hand-written list, so a stream or endpoint added there is permitted here without further edits.

What each grant is for (``P`` the prefix, ``S`` a stream name of the run, ``C`` its durable consumer,
``B`` a KV bucket of the run)::

    every JetStream role   $JS.API.STREAM.INFO.S and .KV_B                     await_topology
                           $JS.API.CONSUMER.INFO.S.C                           await_topology
                           $JS.API.INFO                                        account limits (read)
    run (creator)          $JS.API.STREAM.{CREATE,UPDATE}.S and .KV_B          ensure_topology
                           $JS.API.CONSUMER.{CREATE,DURABLE.CREATE}.S.C(.>)    ensure_topology
    stream publishers      P.<kind>.<run>                                      js_publish
    consumer members       $JS.API.CONSUMER.MSG.NEXT.S.C, $JS.ACK.S.C.>        fetch, ack/nak/in-progress
    message readers        $JS.API.STREAM.MSG.GET.S                            read stored messages (run: traj,
                                                                               rollout: model)
    bucket readers         $JS.API.DIRECT.GET.KV_B(.>), STREAM.MSG.GET.KV_B    get
                           $JS.API.CONSUMER.{CREATE,INFO,DELETE}.KV_B.>        watch (ephemeral consumer)
    bucket writers         $KV.B.>                                             put / update
    endpoint servers       sub the endpoint's subject + responses              serve (``ENDPOINTS``)
    endpoint callers       pub the endpoint's subject                          request
    every role             sub _INBOX.<role>.>                                 replies to its requests

Endpoint subjects are granted with ``*`` for their fields (``P.env.*.lease``), except that an env
server's grants name its pools when ``pools`` is given (``P.env.sim.lease``, ``P.env.sim.inst.*.*``):
an env user of one pool cannot serve, or read the calls of, another pool.

Replies to requests need no publish grant: ``allow_responses`` lets a server answer the reply
subject of a request it received, once, within the longest ``reply_window_s`` of the endpoints it
serves (two hours for env operations, whose deadline ``env.op_timeout_s`` may be one; six for the
rollout service's evaluations). A role's inbox
prefix is ``_INBOX.<role>`` (the bus sets it from ``bus.user``), so no role can subscribe to another
role's replies.

Only the ``run`` role (``dart run``'s supervisor, ``dart topology`` in a deployment) may create and
update the run's streams, consumers and bucket (nobody may delete or purge them); the services only
find and bind to them (:func:`dart.runtime.topology.open_topology`), so no service can add a subject
it publishes on to a stream another role consumes, or change a consumer another role reads from.
Roles are per service, not per process: two rollout replicas share a user. The control-plane subjects
(``P.ctl.*``) are granted to nobody until an endpoint declares them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dart.protocol.endpoints import ENDPOINTS, ENV_OP_TIMEOUT_MAX_S, ENV_REPLY_WINDOW_S, EVAL_REPLY_WINDOW_S
from dart.protocol.subjects import Subjects, inbox_prefix
from dart.protocol.topology import BUCKETS, ROLES, STREAMS, Role

__all__ = [
    "ENV_OP_TIMEOUT_MAX_S",
    "ENV_REPLY_WINDOW_S",
    "EVAL_REPLY_WINDOW_S",
    "JS_API",
    "Permissions",
    "service_permissions",
]

JS_API = "$JS.API"

_JETSTREAM_ROLES: frozenset[Role] = frozenset({"rollout", "data", "train", "run", "eval"})
"""Roles that use JetStream, and so look the run's streams and consumers up."""
_TOPOLOGY_ADMIN = "run"
"""The role that creates and updates the run's streams, consumers and bucket (``TOPOLOGY_CREATORS``)."""


@dataclass(frozen=True)
class Permissions:
    """What one NATS user may do; everything else is denied.

    Attributes:
        publish: Subjects (with ``*`` / ``>`` wildcards) the user may publish to.
        subscribe: Subjects the user may subscribe to.
        allow_responses: Whether the user may answer requests it received (RPC servers).
        response_window_s: How long after a request its one reply may be sent, seconds; None keeps
            nats-server's default (2 minutes).
    """

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool
    response_window_s: int | None = None


def service_permissions(role: Role, prefix: str, run: str, pools: Sequence[str] | None = None) -> Permissions:
    """The publish and subscribe allow lists of one role for one prefix and run.

    Args:
        role: The service (or supervisor) connecting.
        prefix: Subject prefix (``bus.prefix``).
        run: Run token (``bus.run``); stream, consumer and bucket names are scoped to it.
        pools: The env pools this user serves (``env.pool``); its pool-scoped endpoint grants name them.
            None grants every pool (``*``).

    Raises:
        ValueError: ``role`` is not one of :data:`~dart.protocol.topology.ROLES`.
        SubjectError: ``prefix`` or ``run`` is not a valid subject fragment.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    subjects = Subjects(prefix=prefix, run=run)
    pub: list[str] = []
    sub: list[str] = [f"{inbox_prefix(role)}.>"]

    if role in _JETSTREAM_ROLES:
        pub.append(f"{JS_API}.INFO")
        admin = role == _TOPOLOGY_ADMIN
        stream_ops = ("INFO", "CREATE", "UPDATE") if admin else ("INFO",)
        for kind, spec in STREAMS.items():
            name = subjects.stream_name(kind)
            pub += [f"{JS_API}.STREAM.{op}.{name}" for op in stream_ops]
            if role in spec.publishers:
                pub.append(subjects.stream_subject(kind))
            if role in spec.message_readers:
                pub.append(f"{JS_API}.STREAM.MSG.GET.{name}")
            if spec.consumer is None:
                continue
            durable = subjects.consumer_name(kind, spec.consumer.group)
            pub.append(f"{JS_API}.CONSUMER.INFO.{name}.{durable}")
            if admin:
                pub += [
                    f"{JS_API}.CONSUMER.CREATE.{name}.{durable}",
                    f"{JS_API}.CONSUMER.CREATE.{name}.{durable}.>",
                    f"{JS_API}.CONSUMER.DURABLE.CREATE.{name}.{durable}",
                ]
            if role in spec.consumer.consumers:
                pub += [f"{JS_API}.CONSUMER.MSG.NEXT.{name}.{durable}", f"$JS.ACK.{name}.{durable}.>"]
        for bucket in BUCKETS.values():
            kv = subjects.kv_bucket(bucket.name)
            stream = f"KV_{kv}"
            pub += [f"{JS_API}.STREAM.{op}.{stream}" for op in stream_ops]
            if role in bucket.readers or role in bucket.writers:
                pub += [
                    f"{JS_API}.DIRECT.GET.{stream}",
                    f"{JS_API}.DIRECT.GET.{stream}.>",
                    f"{JS_API}.STREAM.MSG.GET.{stream}",
                ]
            if role in bucket.readers:
                pub += [f"{JS_API}.CONSUMER.{op}.{stream}.>" for op in ("CREATE", "INFO", "DELETE")]
                pub.append(f"{JS_API}.CONSUMER.CREATE.{stream}")
            if role in bucket.writers:
                pub.append(f"$KV.{kv}.>")

    windows: list[int] = []
    for endpoint in ENDPOINTS.values():
        scoped = [{"pool": pool} for pool in pools] if pools is not None and endpoint.pool_scoped else [{}]
        patterns = [subjects.endpoint_pattern(endpoint.name, **fields) for fields in scoped]
        if role == endpoint.server:
            sub += patterns
            windows.append(endpoint.reply_window_s or 0)
        if role in endpoint.callers:
            pub += patterns if role == endpoint.server else [subjects.endpoint_pattern(endpoint.name)]
    return Permissions(
        publish=tuple(dict.fromkeys(pub)),
        subscribe=tuple(dict.fromkeys(sub)),
        allow_responses=bool(windows),
        response_window_s=max(windows, default=0) or None,
    )
