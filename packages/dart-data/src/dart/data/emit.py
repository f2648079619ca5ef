"""Work emission: the seam between the data manager and its two emitters, and the decoupled one.

An emitter plans work groups (:class:`dart.data.work.WorkPlanner`), publishes their work items to
the ``work`` stream and keeps an account of what it still waits for; the ingestor tells it which
groups' trajectories arrived. ``emission.mode`` picks the emitter: :class:`DecoupledEmitter` here
(DART: keep ``decoupled.max_outstanding`` trajectories requested, never wait for training, but
pause while the trainer's backlog exceeds ``decoupled.max_queued_batches``) or
:class:`dart.data.coupled.CoupledEmitter` (the synchronous baseline).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from dart.data.config import EmissionConfig
from dart.data.state import DataState
from dart.data.work import OutstandingWork, WorkPlanner, min_policy_version
from dart.protocol.errors import JetStreamError
from dart.protocol.messages import WorkItem
from dart.runtime.bus import Bus
from dart.runtime.topology import durable_name
from dart.runtime.waiting import wait_event

log = logging.getLogger("dart.data")


class Emitter(Protocol):
    """What the data manager needs of an emitter."""

    outstanding: OutstandingWork
    """Trajectories requested and not yet received."""

    def arrived(self, group_id: str) -> None:
        """A new trajectory of this work group was ingested (and its group handled)."""

    async def run(self) -> None:
        """Emit work until ``emission.max_groups`` groups were emitted, or forever."""


async def publish_work(state: DataState, bus: Bus, items: list[WorkItem], *, new_group: bool = True) -> None:
    """Record one group ``open`` and its work items in the index (what the ingestion checks a
    trajectory against), then publish the items, retrying until the bus took them (work ids are
    dedupe ids, so publishing an item again is harmless). ``new_group=False`` for more items of a group
    already emitted (branches), counted as ``branches``."""
    subject = bus.subjects.stream_subject("work")
    while True:
        try:
            await state.db(state.index.record_work, items)
            for item in items:
                await bus.js_publish(subject, item, msg_id=item.work_id)
            break
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("emitting work failed; retrying")
            await asyncio.sleep(1.0)
    if new_group:
        state.counters["work_groups"] += 1
    else:
        state.counters["branches"] += len(items)
    state.counters["work_items"] += len(items)


class DecoupledEmitter:
    """Keeps the rollout service saturated with work at a bounded policy lag.

    Work lifecycle: ``planned`` at the current version (``min_policy_version`` = version -
    ``grouping.max_staleness``) -> ``waiting`` while emitting the whole group would exceed
    ``max_outstanding``, or while more than ``max_queued_batches`` batches wait untrained on the
    ``batch`` stream (``throttled``; the floor is refreshed afterwards: a newer version may have come
    meanwhile) -> ``emitted`` -> its trajectories arrive, or it expires ``work_timeout_s`` after
    emission.

    The backlog is the trainer's durable consumer's ``num_pending + num_ack_pending`` (stored batches
    not yet acked, the one in training included), read from JetStream itself: it needs no cooperation
    from the trainer, survives restarts of either service and counts redeliveries. Work emitted while
    the trainer lags would only be trained stale, or dropped by the trainer's staleness check.
    """

    def __init__(self, emission: EmissionConfig, state: DataState, bus: Bus, planner: WorkPlanner) -> None:
        """Create the emitter.

        Args:
            emission: Emission settings (``emission.decoupled`` for this emitter's own).
            state: The data manager's shared state (version, counters, index).
            bus: A connected bus (work goes to its ``work`` stream).
            planner: Plans each group's task, size and step budget.
        """
        self._emission = emission
        self._state = state
        self._bus = bus
        self._planner = planner
        self.outstanding = OutstandingWork(state.clock)
        self._capacity = asyncio.Event()
        self._throttled = False

    def arrived(self, group_id: str) -> None:
        """A trajectory arrived: room for more work, if it was one this emitter waited for."""
        if self.outstanding.received(group_id):
            self._capacity.set()

    async def run(self) -> None:
        """Emit until ``max_groups`` groups were emitted (forever when None)."""
        emission, own = self._emission, self._emission.decoupled
        staleness = self._state.config.grouping.max_staleness
        items: list[WorkItem] | None = None
        while emission.max_groups is None or self._planner.groups_planned < emission.max_groups or items:
            if self._state.env_budget_spent():
                log.info("the env budget of %d steps is spent: no more work", emission.max_env_steps)
                return
            items = items or self._planner.next_group(self._state.version, staleness)
            outstanding = self.outstanding.count
            if outstanding and outstanding + len(items) > own.max_outstanding:
                self._capacity.clear()
                if not await wait_event(self._capacity, own.poll_interval_s):
                    self.outstanding.expire(emission.work_timeout_s)
                continue
            if await self._trainer_backlogged():
                await asyncio.sleep(own.poll_interval_s)
                self.outstanding.expire(emission.work_timeout_s)
                continue
            # Items planned before a wait may predate a new policy version: refresh their floor.
            floor = min_policy_version(self._state.version, staleness)
            if items[0].min_policy_version != floor:
                items = [w.model_copy(update={"min_policy_version": floor}) for w in items]
            # Counted before publishing: a fast runner's trajectory may arrive mid-group.
            self.outstanding.emitted(items[0].group_id, len(items))
            await publish_work(self._state, self._bus, items)
            items = None

    async def _trainer_backlogged(self) -> bool:
        """Whether more than ``max_queued_batches`` batches wait untrained (counts each pause once)."""
        limit = self._emission.decoupled.max_queued_batches
        if limit is None:
            return False
        try:
            backlog = await self._bus.consumer_state("batch", durable_name(self._bus, "batch"))
        except JetStreamError as exc:
            # The trainer's own staleness check keeps the bound without this throttle: emit rather than stall.
            log.warning("reading the trainer's backlog failed; emitting anyway: %s", exc)
            return False
        queued = backlog.num_pending + backlog.num_ack_pending
        throttled = queued > limit
        if throttled and not self._throttled:
            self._state.counters["emission_throttles"] += 1
            log.info("pausing work emission: %d batches wait for the trainer (limit %d)", queued, limit)
            if self._state.telemetry is not None:
                self._state.telemetry.event("data.emission_throttled", queued_batches=queued, limit=limit)
        self._throttled = throttled
        return throttled
