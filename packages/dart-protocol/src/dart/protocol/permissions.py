"""Per-service NATS permissions, derived from the subjects and the topology.

Each DART process connects as one role (:data:`~dart.protocol.topology.Role`): ``env``, ``rollout``,
``data``, ``train``, the ``dart run`` supervisor (``run``) or ``dart eval`` (``eval``). What a role
may publish and subscribe to follows from :mod:`dart.protocol.subjects` (the names) and
:mod:`dart.protocol.topology` (who publishes, consumes, reads and writes what), never from a second
hand-written list, so a stream added there is permitted here without further edits.

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
    env                    sub P.env.*.lease, P.env.inst.*.* + responses       serve leases and instances
                           sub P.env.*.capabilities                            say what the pool runs
                           pub P.env.inst.*.heartbeat                          probe for taken instance ids
    rollout, eval          pub P.env.*.lease, P.env.inst.*.*                   lease and drive envs
    data, eval             pub P.env.*.capabilities                            keep the tasks the pool runs
    rollout                sub P.eval.<run> + responses                        evaluate on its engines
    eval                   pub P.eval.<run>                                    request such an evaluation
    every role             sub _INBOX.<role>.>                                 replies to its requests

Replies to requests need no publish grant: ``allow_responses`` lets a server answer the reply
subject of a request it received, once, within a window (two hours for env operations, whose
deadline ``env.op_timeout_s`` may be one; six for the rollout service's evaluations). A role's inbox
prefix is ``_INBOX.<role>`` (the bus sets it from ``bus.user``), so no role can subscribe to another
role's replies.

Only the ``run`` role (``dart run``'s supervisor, ``dart topology`` in a deployment) may create and
update the run's streams, consumers and bucket (nobody may delete or purge them); the services only
find and bind to them (:func:`dart.protocol.topology.open_topology`), so no service can add a subject
it publishes on to a stream another role consumes, or change a consumer another role reads from.
Roles are per service, not per process: two rollout replicas share a user. The control-plane subjects
(``P.ctl.*``) are granted to nobody until a service serves them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dart.protocol.subjects import Subjects, inbox_prefix
from dart.protocol.topology import BUCKETS, ROLES, STREAMS, Role

JS_API = "$JS.API"

_JETSTREAM_ROLES: frozenset[Role] = frozenset({"rollout", "data", "train", "run", "eval"})
"""Roles that use JetStream, and so look the run's streams and consumers up."""
_TOPOLOGY_ADMIN = "run"
"""The role that creates and updates the run's streams, consumers and bucket (``TOPOLOGY_CREATORS``)."""
_ENV_CALLERS: frozenset[Role] = frozenset({"rollout", "eval"})


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


EVAL_REPLY_WINDOW_S = 6 * 3600
"""How long the rollout service may take to answer an evaluation request (a held-out suite on a real
checkpoint takes many minutes), seconds."""

ENV_OP_TIMEOUT_MAX_S = 3600
"""The longest deadline ``env.op_timeout_s`` may give one backend operation (a VM's boot, a heavy
setup), seconds."""

ENV_REPLY_WINDOW_S = 2 * ENV_OP_TIMEOUT_MAX_S
"""How long the env service may take to answer a call, seconds: an operation at its longest deadline
plus the restart of the backend it crashed. With nats-server's default (2 minutes) the reply to a
longer reset was dropped and the caller ran the reset again."""


def service_permissions(role: Role, prefix: str, run: str) -> Permissions:
    """The publish and subscribe allow lists of one role for one prefix and run.

    Args:
        role: The service (or supervisor) connecting.
        prefix: Subject prefix (``bus.prefix``).
        run: Run token (``bus.run``); stream, consumer and bucket names are scoped to it.

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

    if role == "env":
        sub += [f"{prefix}.env.*.lease", f"{prefix}.env.*.capabilities", f"{prefix}.env.inst.*.*"]
        pub.append(f"{prefix}.env.inst.*.heartbeat")
    if role in _ENV_CALLERS:
        pub += [f"{prefix}.env.*.lease", f"{prefix}.env.inst.*.*"]
    if role in ("data", "eval"):
        pub.append(f"{prefix}.env.*.capabilities")
    if role == "rollout":
        sub.append(subjects.eval_request())
    if role == "eval":
        pub.append(subjects.eval_request())
    return Permissions(
        publish=tuple(dict.fromkeys(pub)),
        subscribe=tuple(dict.fromkeys(sub)),
        allow_responses=role in ("env", "rollout"),
        response_window_s={"rollout": EVAL_REPLY_WINDOW_S, "env": ENV_REPLY_WINDOW_S}.get(role),
    )
