"""The lease book: checks the lease id of every instance call, ends leases, and remembers why they ended."""

from __future__ import annotations

import logging

from dart.env.service.instance import InstanceSlot
from dart.env.service.lease import EndedLeases, EndReason, Lease
from dart.protocol.errors import ServiceError
from dart.protocol.messages import ErrorCode

log = logging.getLogger("dart.env.service")


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
