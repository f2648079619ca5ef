"""One hosted env instance: its backend, its lease, its lock and its counters."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum

from dart.env.interface import EnvBackend
from dart.env.service.health import InstanceHealth
from dart.env.service.lease import Lease
from dart.protocol.messages import StepReply
from dart.runtime.telemetry import BusyTracker


class SlotState(StrEnum):
    """Where an instance slot is in its lifecycle (see :class:`InstanceSlot`)."""

    STARTING = "starting"
    """The backend is being started; not leasable yet."""
    FREE = "free"
    """Started and not leased; the next lease request may get it."""
    LEASED = "leased"
    """Held by a lease; only calls carrying that lease id are served."""
    REPLACING = "replacing"
    """The backend crashed, or reached a recycle limit; it is being swapped for a fresh one."""
    RETIRED = "retired"
    """Crashed or failed to start ``max_consecutive_failures`` times in a row; never leased again."""
    STOPPED = "stopped"
    """The service stopped; the backend is closed."""


@dataclass(frozen=True)
class InstanceStats:
    """A snapshot of one instance's counters.

    Attributes:
        instance_id: The instance.
        state: Its slot state (``free``, ``leased`` ...).
        holder: The current lease holder, or None.
        busy_s: Busy seconds per operation (``reset``, ``step``, ``evaluate``) since the service started.
        idle_s: Seconds since the service started that the instance spent not in an operation.
        resets: Episodes started.
        steps: Actions executed.
        evaluations: Evaluations run.
        failures: Crashes (backend errors and timeouts) and failed restarts.
        restarts: Backends replaced after a crash.
        recycles: Backends replaced before they rotted, by reason (``episodes``, ``memory``, ``slow_steps``).
        episodes: Episodes released on the current backend.
        rss_mib: Resident memory of the current backend's processes at the latest release, MiB.
        step_latency_ratio: The current backend's recent mean step latency over its first.
        leases_granted: Leases granted on this instance.
        leases_released: Leases released by their holder.
        leases_expired: Leases freed because their holder stopped heartbeating.
    """

    instance_id: str
    state: SlotState
    holder: str | None
    busy_s: dict[str, float]
    idle_s: float
    resets: int
    steps: int
    evaluations: int
    failures: int
    restarts: int
    recycles: dict[str, int]
    episodes: int
    rss_mib: float
    step_latency_ratio: float
    leases_granted: int
    leases_released: int
    leases_expired: int


@dataclass
class InstanceSlot:
    """A place in the pool that holds one backend at a time (replaced on a crash, same id).

    Lifecycle::

        starting --started--> free --lease--> leased --release / expiry--> free
                                                 |
                                                 +--crash--> replacing --restarted--> free
                                                 +--released past a recycle limit--> replacing --fresh--> free
                                                                 |
                                                                 +--too many failures--> retired
        any state --service stop--> stopped

    Calls on the backend are serialized by :attr:`lock` (a GUI env does one thing at a time);
    heartbeats do not take it, so a holder stays alive during a long step.

    Attributes:
        index: Slot number in the pool.
        instance_id: Stable id; a replacement backend keeps it.
        backend: The current backend.
        tracker: Busy/idle accounting, one per slot across replacements.
        state: Lifecycle state.
        lease: The current lease while ``leased``.
        lock: Serializes backend calls and releases.
        running_op: The operation in progress, if any (the reaper never expires such a lease).
        generation: How many backends this slot has had, minus one.
        consecutive_failures: Crashes and failed restarts since the last successful evaluate.
        last_task_id: Task of the latest reset, to honour lease task hints.
        next_step_index: The ``step_index`` the next step request must carry.
        last_step: The reply to the latest step, returned again for a duplicated request.
        free_since: Monotonic time the slot last became free (least recently used goes first).
    """

    index: int
    instance_id: str
    backend: EnvBackend
    tracker: BusyTracker
    state: SlotState = SlotState.STARTING
    lease: Lease | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    running_op: str | None = None
    generation: int = 0
    consecutive_failures: int = 0
    last_task_id: str | None = None
    next_step_index: int = 0
    last_step: StepReply | None = None
    free_since: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.monotonic)
    resets: int = 0
    steps: int = 0
    evaluations: int = 0
    failures: int = 0
    restarts: int = 0
    recycles: dict[str, int] = field(default_factory=dict)
    health: InstanceHealth = field(default_factory=lambda: InstanceHealth(50))
    rss_mib: float = 0.0
    leases_granted: int = 0
    leases_released: int = 0
    leases_expired: int = 0

    def grant(self, lease: Lease) -> None:
        """Hand the slot to ``lease`` (the slot must be free)."""
        assert self.state == SlotState.FREE, self.state
        self.state = SlotState.LEASED
        self.lease = lease
        self.leases_granted += 1
        # A new holder starts a new episode numbering; a stale cached reply must not leak to it.
        self.next_step_index = 0
        self.last_step = None

    def free(self) -> None:
        """Drop the lease and make the slot leasable again."""
        self.lease = None
        self.state = SlotState.FREE
        self.free_since = time.monotonic()
        self.last_step = None

    def stats(self) -> InstanceStats:
        """A snapshot of the counters."""
        busy = self.tracker.totals()
        uptime = time.monotonic() - self.started_at
        return InstanceStats(
            instance_id=self.instance_id,
            state=self.state,
            holder=self.lease.holder if self.lease is not None else None,
            busy_s=busy,
            idle_s=max(0.0, uptime - sum(busy.values())),
            resets=self.resets,
            steps=self.steps,
            evaluations=self.evaluations,
            failures=self.failures,
            restarts=self.restarts,
            recycles=dict(self.recycles),
            episodes=self.health.episodes,
            rss_mib=self.rss_mib,
            step_latency_ratio=self.health.step_latency_ratio,
            leases_granted=self.leases_granted,
            leases_released=self.leases_released,
            leases_expired=self.leases_expired,
        )
