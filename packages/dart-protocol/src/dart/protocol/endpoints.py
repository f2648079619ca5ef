"""Every request/reply endpoint DART serves: its subject, message types, serving role and caller roles.

The request/reply counterpart of :data:`dart.protocol.topology.STREAMS`. Each :class:`Endpoint` names its
subject template (:data:`dart.protocol.subjects.ENDPOINT_SUBJECTS`), the request it takes and the reply it
gives, the one role that serves it and the roles that may call it.
:func:`dart.protocol.permissions.service_permissions` derives every role's grants from this table (a
subscribe grant for the server, a publish grant for each caller, ``allow_responses`` with the longest
reply window of the endpoints a role serves), so an endpoint is declared once.

=====================  ===================  ===================  ========  ======================
endpoint               request              reply                served by called by
=====================  ===================  ===================  ========  ======================
``env.lease``          LeaseRequest         LeaseReply           env       rollout, eval
``env.capabilities``   CapabilitiesRequest  EnvCapabilities      env       data, eval
``env.reset``          ResetRequest         ResetReply           env       rollout, eval
``env.step``           StepRequest          StepReply            env       rollout, eval
``env.evaluate``       EvaluateRequest      EvaluateReply        env       rollout, eval
``env.release``        ReleaseRequest       ReleaseReply         env       rollout, eval
``env.heartbeat``      HeartbeatRequest     HeartbeatReply       env       rollout, eval, env
``eval``               EvalRequest          EvalResult           rollout   eval
=====================  ===================  ===================  ========  ======================

The env service calls ``env.heartbeat`` itself: at start it probes each of its instance ids for another
process already serving it. The env endpoints carry the pool in their subject, so an env user whose
permissions name its pool can serve that pool only. The control plane (``P.ctl.*``) has no endpoint yet:
no role is granted it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dart.protocol.messages import (
    CapabilitiesRequest,
    EnvCapabilities,
    EvalRequest,
    EvalResult,
    EvaluateReply,
    EvaluateRequest,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseReply,
    LeaseRequest,
    ReleaseReply,
    ReleaseRequest,
    ResetReply,
    ResetRequest,
    StepReply,
    StepRequest,
)
from dart.protocol.messages.base import Message
from dart.protocol.subjects import ENDPOINT_SUBJECTS, EndpointName
from dart.protocol.topology import Role

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

_ENV_CALLERS: tuple[Role, ...] = ("rollout", "eval")


@dataclass(frozen=True)
class Endpoint:
    """One request/reply endpoint.

    Attributes:
        name: Key of the subject template in :data:`~dart.protocol.subjects.ENDPOINT_SUBJECTS`.
        request: The message a caller sends.
        reply: The message the server answers with (or an ``ErrorReply``).
        server: The role that subscribes to the subject and answers.
        callers: The roles that may send requests to it.
        reply_window_s: How long after a request its one reply may be sent, seconds; None keeps
            nats-server's default (2 minutes).
        pool_scoped: Whether the subject names an env pool (``{pool}``), to which a server's
            subscription may be limited.
    """

    name: EndpointName
    request: type[Message]
    reply: type[Message]
    server: Role
    callers: tuple[Role, ...]
    reply_window_s: int | None = None

    @property
    def pool_scoped(self) -> bool:
        return "{pool}" in ENDPOINT_SUBJECTS[self.name]


ENDPOINTS: dict[EndpointName, Endpoint] = {
    e.name: e
    for e in (
        Endpoint("env.lease", LeaseRequest, LeaseReply, "env", _ENV_CALLERS, ENV_REPLY_WINDOW_S),
        Endpoint("env.capabilities", CapabilitiesRequest, EnvCapabilities, "env", ("data", "eval"), ENV_REPLY_WINDOW_S),
        Endpoint("env.reset", ResetRequest, ResetReply, "env", _ENV_CALLERS, ENV_REPLY_WINDOW_S),
        Endpoint("env.step", StepRequest, StepReply, "env", _ENV_CALLERS, ENV_REPLY_WINDOW_S),
        Endpoint("env.evaluate", EvaluateRequest, EvaluateReply, "env", _ENV_CALLERS, ENV_REPLY_WINDOW_S),
        Endpoint("env.release", ReleaseRequest, ReleaseReply, "env", _ENV_CALLERS, ENV_REPLY_WINDOW_S),
        Endpoint("env.heartbeat", HeartbeatRequest, HeartbeatReply, "env", (*_ENV_CALLERS, "env"), ENV_REPLY_WINDOW_S),
        Endpoint("eval", EvalRequest, EvalResult, "rollout", ("eval",), EVAL_REPLY_WINDOW_S),
    )
}
"""Every request/reply endpoint, by name (the same keys as ``ENDPOINT_SUBJECTS``)."""
