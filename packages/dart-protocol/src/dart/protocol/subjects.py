"""Every NATS subject, stream, consumer and KV bucket name DART uses, built from one prefix.

No other module writes a subject string. Services obtain a :class:`Subjects` from their config
(``bus.prefix``, default ``dart.v1``) and ask it for names, so two runs with different prefixes
share a NATS server without seeing each other's traffic.

Layout (prefix ``P``)::

    P.env.<pool>.lease                 request: lease an env instance from a pool
    P.env.<pool>.capabilities          request: what a pool runs (its backend, the task requirements it meets)
    P.env.inst.<instance>.<op>         request: reset / step / evaluate / release / heartbeat
    P.work.<run>                       JetStream: work items (one trajectory each)
    P.traj.<run>                       JetStream: finished trajectories
    P.batch.<run>                      JetStream: training batches
    P.model.<run>                      JetStream: model version announcements
    P.eval.<run>                       request: evaluate a version on the rollout service's engines
    P.ctl.<service>.<op>               request: control plane (status, shutdown)
    P.bench.<name>                     request: benchmarks and tests
    _INBOX.<user>.<id>                 replies to one NATS user's requests
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from dart.protocol.errors import SubjectError

DEFAULT_PREFIX = "dart.v1"
INBOX_ROOT = "_INBOX"

EnvOp = Literal["reset", "step", "evaluate", "release", "heartbeat"]
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
    def env_lease(self, pool: str) -> str:
        """Subject on which an env pool answers lease requests."""
        return f"{self.prefix}.env.{_check_token(pool, 'pool')}.lease"

    def env_capabilities(self, pool: str) -> str:
        """Subject on which an env pool says what it runs (:class:`~dart.protocol.messages.EnvCapabilities`)."""
        return f"{self.prefix}.env.{_check_token(pool, 'pool')}.capabilities"

    def env_instance(self, instance_id: str, op: EnvOp) -> str:
        """Subject of one operation on one leased env instance."""
        return f"{self.prefix}.env.inst.{_check_token(instance_id, 'instance id')}.{op}"

    def eval_request(self) -> str:
        """Subject on which the run's rollout service evaluates a policy version on its engines."""
        return f"{self.prefix}.eval.{self.run}"

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
