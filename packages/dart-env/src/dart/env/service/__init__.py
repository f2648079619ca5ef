"""The env service: pools of env backend instances served over NATS request/reply.

Modules: :mod:`.config` (:class:`EnvServiceConfig`), :mod:`.lease`
(leases and their lifecycle), :mod:`.instance` (one hosted instance and its counters),
:mod:`.service` (:class:`EnvService`).
"""

from __future__ import annotations

from dart.env.service.config import EnvServiceConfig
from dart.env.service.instance import InstanceStats, SlotState
from dart.env.service.lease import EndReason, Lease
from dart.env.service.service import EnvService, SpareStats

__all__ = [
    "EndReason",
    "EnvService",
    "EnvServiceConfig",
    "InstanceStats",
    "Lease",
    "SlotState",
    "SpareStats",
]
