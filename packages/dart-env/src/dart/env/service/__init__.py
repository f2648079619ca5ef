"""The env service: pools of env backend instances served over NATS request/reply.

Modules: :mod:`.config` (:class:`EnvServiceConfig`), :mod:`.lease`
(leases and their lifecycle), :mod:`.instance` (one hosted instance and its counters),
:mod:`.lease_book` (lease checks on instance calls), :mod:`.pool_tasks` (the tasks a pool runs, by id),
:mod:`.spares` (warm spares that replace crashed instances), :mod:`.service` (:class:`EnvService`).
"""

from __future__ import annotations

from dart.env.service.config import EnvServiceConfig
from dart.env.service.instance import InstanceStats, SlotState
from dart.env.service.lease import EndReason, Lease
from dart.env.service.service import EnvService
from dart.env.service.spares import SpareStats

__all__ = [
    "EndReason",
    "EnvService",
    "EnvServiceConfig",
    "InstanceStats",
    "Lease",
    "SlotState",
    "SpareStats",
]
