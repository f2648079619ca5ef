"""Every NATS subject, stream, consumer and KV bucket name DART uses, built from one prefix.

No other module writes a subject string. Services obtain a :class:`Subjects` from their config
(``bus.prefix``, default ``dart.v1``) and ask it for names, so two runs with different prefixes
share a NATS server without seeing each other's traffic.

Layout (prefix ``P``)::

    P.env.<pool>.lease                 request: lease an env instance from a pool
    P.env.<pool>.capabilities          request: what a pool runs (its backend, the task requirements it meets)
    P.env.<pool>.inst.<instance>.<op>  request: reset / step / evaluate / release / heartbeat
    P.work.<run>                       JetStream: work items (one trajectory each)
    P.traj.<run>                       JetStream: finished trajectories
    P.batch.<run>                      JetStream: training batches
    P.model.<run>                      JetStream: model version announcements
    P.eval.<run>                       request: evaluate a version on the rollout service's engines
    P.ctl.<service>.<op>               control plane (status, shutdown): reserved, served by nobody yet
    P.bench.<name>                     request: benchmarks and tests
    _INBOX.<user>.<id>                 replies to one NATS user's requests

The request/reply subjects are :data:`ENDPOINT_SUBJECTS` templates, filled by :meth:`Subjects.endpoint`
(a subject) or :meth:`Subjects.endpoint_pattern` (a wildcard for permissions); who serves and calls each,
with which message types, is :data:`dart.protocol.endpoints.ENDPOINTS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from dart.protocol.errors import SubjectError

DEFAULT_PREFIX = "dart.v1"
INBOX_ROOT = "_INBOX"

EnvOp = Literal["reset", "step", "evaluate", "release", "heartbeat"]
EndpointName = Literal[
    "env.lease", "env.capabilities", "env.reset", "env.step", "env.evaluate", "env.release", "env.heartbeat", "eval"
]

ENDPOINT_SUBJECTS: dict[EndpointName, str] = {
    "env.lease": "env.{pool}.lease",
    "env.capabilities": "env.{pool}.capabilities",
    "env.reset": "env.{pool}.inst.{instance}.reset",
    "env.step": "env.{pool}.inst.{instance}.step",
    "env.evaluate": "env.{pool}.inst.{instance}.evaluate",
    "env.release": "env.{pool}.inst.{instance}.release",
    "env.heartbeat": "env.{pool}.inst.{instance}.heartbeat",
    "eval": "eval.{run}",
}
"""Each request/reply endpoint's subject after the prefix; ``{run}`` is the run, other fields are tokens."""

_FIELD = re.compile(r"\{(\w+)\}")
StreamKind = Literal["work", "traj", "batch", "model"]

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def _check_token(token: str, what: str) -> str:
    if not _TOKEN.match(token):
        raise SubjectError(f"{what} {token!r} must be a non-empty run of letters, digits, '_' or '-'")
    return token


def inbox_prefix(user: str) -> str:
    """The reply-inbox prefix of a NATS user's connections, e.g. ``_INBOX.rollout`` (see ``permissions``)."""
    return f"{INBOX_ROOT}.{_check_token(user, 'user')}"


@dataclass(frozen=True)
class Subjects:
    """Subject and JetStream name builder for one prefix and run.

    Attributes:
        prefix: Dot-separated subject prefix, e.g. ``dart.v1``.
        run: Run identifier; JetStream subjects and names are scoped to it so runs never mix.
    """

    prefix: str = DEFAULT_PREFIX
    run: str = "default"

    def __post_init__(self) -> None:
        for token in self.prefix.split("."):
            _check_token(token, "subject prefix token")
        _check_token(self.run, "run id")

    # --- core request/reply -------------------------------------------------------------------
    def endpoint(self, name: EndpointName, **fields: str) -> str:
        """The subject of one endpoint, every field of its template given (``pool``, ``instance``).

        Raises:
            SubjectError: A field is missing or not a valid token.
        """
        return self._fill(name, fields, wildcard=False)

    def endpoint_pattern(self, name: EndpointName, **fields: str) -> str:
        """The endpoint's subject with ``*`` for each field not given: what a permission grants."""
        return self._fill(name, fields, wildcard=True)

    def env_lease(self, pool: str) -> str:
        """Subject on which an env pool answers lease requests."""
        return self.endpoint("env.lease", pool=pool)

    def env_capabilities(self, pool: str) -> str:
        """Subject on which an env pool says what it runs (:class:`~dart.protocol.messages.EnvCapabilities`)."""
        return self.endpoint("env.capabilities", pool=pool)

    def env_instance(self, pool: str, instance_id: str, op: EnvOp) -> str:
        """Subject of one operation on one leased env instance of a pool."""
        return self.endpoint(f"env.{op}", pool=pool, instance=instance_id)  # type: ignore[arg-type]

    def eval_request(self) -> str:
        """Subject on which the run's rollout service evaluates a policy version on its engines."""
        return self.endpoint("eval")

    def _fill(self, name: EndpointName, fields: dict[str, str], *, wildcard: bool) -> str:
        def token(match: re.Match[str]) -> str:
            field = match.group(1)
            if field == "run":
                return self.run
            if field in fields:
                return _check_token(fields[field], field)
            if wildcard:
                return "*"
            raise SubjectError(f"endpoint {name!r} needs its {field!r}")

        return f"{self.prefix}.{_FIELD.sub(token, ENDPOINT_SUBJECTS[name])}"

    def control(self, service: str, op: str) -> str:
        """Control-plane subject of a service (status, shutdown, ...)."""
        return f"{self.prefix}.ctl.{_check_token(service, 'service')}.{_check_token(op, 'op')}"

    def bench(self, name: str) -> str:
        """Subject used by benchmarks and tests."""
        return f"{self.prefix}.bench.{_check_token(name, 'bench name')}"

    # --- JetStream ------------------------------------------------------------------------------
    def stream_subject(self, kind: StreamKind) -> str:
        """Subject that messages of one stream are published to."""
        return f"{self.prefix}.{kind}.{self.run}"

    def stream_name(self, kind: StreamKind) -> str:
        """JetStream stream name (no dots allowed there) for one stream kind."""
        return self._upper_name(kind)

    def consumer_name(self, kind: StreamKind, group: str) -> str:
        """Durable consumer name of a consumer group on one stream."""
        return f"{self._upper_name(kind)}_{_check_token(group, 'consumer group')}"

    def kv_bucket(self, name: str) -> str:
        """KV bucket name, e.g. ``kv_bucket('state')`` for run state and the latest model version."""
        return self._upper_name(_check_token(name, "bucket"))

    def _upper_name(self, suffix: str) -> str:
        base = "_".join(self.prefix.split(".")) + "_" + self.run + "_" + suffix
        return base.upper().replace("-", "_")
