"""Leases of env instances: who holds one, until when, and how ended ones are remembered.

Lease lifecycle (one lease, one instance)::

    granted --heartbeat / any successful call--> granted (deadline pushed to now + ttl)
    granted --release------------------------------> ended(released)
    granted --deadline passes, no call in flight---> ended(expired)     (reaper, or the next call)
    granted --backend crashes or times out---------> ended(env_failed)  (the instance is replaced)
    granted --service stops------------------------> ended(stopped)

An ended lease is never granted again; the service remembers why it ended (bounded memory), so
a late call on it gets the precise answer: ``expired``, ``env_failed``, or ``not_found``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from dart.protocol.errors import ServiceError
from dart.protocol.messages import ErrorCode

if TYPE_CHECKING:
    from dart.env.service.instance import InstanceSlot

log = logging.getLogger("dart.env.service")


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
    """

    lease_id: str
    holder: str
    ttl_s: float
    deadline: float
    granted_at: float = field(default_factory=time.monotonic)

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


# A late call on an ended lease is answered with the code that tells the holder what happened.
_ENDED = {
    EndReason.EXPIRED: (ErrorCode.EXPIRED, "lease {lease} expired (no heartbeat within its ttl); lease again"),
    EndReason.ENV_FAILED: (
        ErrorCode.ENV_FAILED,
        "instance {instance} failed under lease {lease}; report the episode as env_failed and lease again",
    ),
    EndReason.RELEASED: (ErrorCode.NOT_FOUND, "lease {lease} was released; lease again"),
    EndReason.STOPPED: (ErrorCode.NOT_FOUND, "lease {lease} ended because the env service stopped; lease again"),
}


class LeaseBook:
    """Checks lease ids on instance calls and ends leases, remembering why each one ended.

    Args:
        capacity: How many ended leases to remember (older ones then answer ``not_found``).
    """

    def __init__(self, capacity: int = 65_536) -> None:
        self._ended = EndedLeases(capacity)

    def authorize(self, slot: InstanceSlot, lease_id: str, *, ended_ok: bool = False) -> Lease | None:
        """The slot's lease if ``lease_id`` holds it now, else raise the error that says why not.

        With ``ended_ok``, a lease that ended (expiring just now included) returns None instead.
        """
        lease = slot.lease
        if lease is not None and lease.lease_id == lease_id:
            # Expire lazily too, so the answer does not depend on when the reaper last ran.
            if not (lease.expired() and slot.running_op is None):
                return lease
            self.end(slot, EndReason.EXPIRED)
        reason = self._ended.get(lease_id)
        if reason is not None:
            if ended_ok:
                return None
            code, message = _ENDED[reason]
            raise ServiceError(
                code,
                message.format(lease=lease_id, instance=slot.instance_id),
                {"instance_id": slot.instance_id, "lease_id": lease_id, "reason": reason.value},
            )
        if slot.lease is not None:
            raise ServiceError(
                ErrorCode.CONFLICT,
                f"instance {slot.instance_id} is held by another lease; use the lease id from your lease reply",
                {"instance_id": slot.instance_id, "lease_id": lease_id},
            )
        raise ServiceError(
            ErrorCode.NOT_FOUND,
            f"lease {lease_id} is unknown on instance {slot.instance_id}; lease an instance first",
            {"instance_id": slot.instance_id, "lease_id": lease_id},
        )

    def end(self, slot: InstanceSlot, reason: EndReason) -> None:
        """End the slot's lease (if any) for ``reason``; the slot becomes free unless it failed."""
        lease = slot.lease
        if lease is None:
            return
        self._ended.add(lease.lease_id, reason)
        if reason == EndReason.RELEASED:
            slot.leases_released += 1
        elif reason == EndReason.EXPIRED:
            slot.leases_expired += 1
            log.info("lease %s of %s on %s expired", lease.lease_id, lease.holder, slot.instance_id)
        if reason == EndReason.ENV_FAILED:
            slot.lease = None  # the slot goes to `replacing`, not back to `free`
        else:
            slot.free()
