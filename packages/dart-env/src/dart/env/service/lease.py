"""Leases of env instances: who holds one, until when, and how ended ones are remembered.

Lease lifecycle (one lease, one instance)::

    granted --heartbeat / any successful call--> granted (deadline pushed to now + ttl)
    granted --release------------------------------> ended(released)
    granted --deadline passes, no call in flight---> ended(expired)     (reaper, or the next call)
    granted --backend crashes or times out---------> ended(env_failed)  (the instance is replaced)
    granted --service stops------------------------> ended(stopped)

An ended lease is never granted again; the service remembers why it ended (bounded memory), so
a late call on it gets the precise answer: ``expired``, ``env_failed``, or ``not_found`` (see
:class:`~dart.env.service.lease_book.LeaseBook`, which checks the lease ids of instance calls).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum


class EndReason(StrEnum):
    """Why a lease ended."""

    RELEASED = "released"
    """The holder released it."""
    EXPIRED = "expired"
    """The holder stopped heartbeating and the deadline passed."""
    ENV_FAILED = "env_failed"
    """The instance crashed (or timed out) during a call; it is being replaced."""
    STOPPED = "stopped"
    """The env service stopped."""


@dataclass
class Lease:
    """One granted lease on one instance.

    Attributes:
        lease_id: Opaque id the holder sends with every call.
        holder: Who holds it (runner id), for diagnostics.
        ttl_s: Lifetime without a heartbeat, seconds.
        deadline: Monotonic time after which the lease is void.
        granted_at: Monotonic time of the grant.
        calls_received: Reset, step and evaluate requests on the lease that reached the service.
        calls_answered: Of those, how many were answered (a reply or an error reply).
    """

    lease_id: str
    holder: str
    ttl_s: float
    deadline: float
    granted_at: float = field(default_factory=time.monotonic)
    calls_received: int = 0
    calls_answered: int = 0

    def touch(self, now: float | None = None) -> None:
        """Push the deadline to ``now + ttl_s`` (a heartbeat, or any successful call)."""
        self.deadline = (time.monotonic() if now is None else now) + self.ttl_s

    def expired(self, now: float | None = None) -> bool:
        """Whether the deadline has passed."""
        return (time.monotonic() if now is None else now) >= self.deadline

    @property
    def expires_at(self) -> float:
        """The deadline as Unix time, seconds (what the wire messages carry)."""
        # Monotonic time decides expiry (immune to clock steps); wall time is only reported.
        return time.time() + max(0.0, self.deadline - time.monotonic())


class EndedLeases:
    """Bounded memory of ended leases and why they ended, oldest forgotten first.

    Args:
        capacity: How many ended leases to remember.
    """

    def __init__(self, capacity: int = 65_536) -> None:
        self._capacity = capacity
        self._reasons: OrderedDict[str, EndReason] = OrderedDict()

    def add(self, lease_id: str, reason: EndReason) -> None:
        """Remember that ``lease_id`` ended for ``reason``."""
        self._reasons[lease_id] = reason
        self._reasons.move_to_end(lease_id)
        while len(self._reasons) > self._capacity:
            self._reasons.popitem(last=False)

    def get(self, lease_id: str) -> EndReason | None:
        """Why ``lease_id`` ended, or None when unknown (never granted, or forgotten)."""
        return self._reasons.get(lease_id)

    def __len__(self) -> int:
        return len(self._reasons)
