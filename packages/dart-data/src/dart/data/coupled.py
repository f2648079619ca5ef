"""The synchronous batch-RL baseline: the coupled emitter and its rounds.

Coupled mode (``emission.mode: coupled``) is the baseline DART's decoupling is measured against.
It runs in rounds; a round's lifecycle:

``emitting`` (B = ``emission.coupled.tasks_per_round`` groups planned at the current policy version,
every work item published) ->
``collecting`` (trajectories arrive and close their groups; nothing else is emitted) ->
``closed`` when every requested trajectory arrived, or ``work_timeout_s`` after emission (the
missing ones are counted as lost, and the round's groups still open are closed with what they
have) -> ``trained``: all the round's groups that survived the usual filters form ONE training
batch; an empty round skips training -> ``synced`` once the trainer put a newer model version in
the state bucket -> the next round is emitted at that version. Staleness is therefore always 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dart.data.config import EmissionConfig
from dart.data.emit import publish_work
from dart.data.former import BatchFormer
from dart.data.state import DataState
from dart.data.work import OutstandingWork, WorkPlanner
from dart.runtime.bus import Bus
from dart.runtime.waiting import wait_event

log = logging.getLogger("dart.data")


@dataclass
class CoupledRound:
    """Book-keeping of one coupled round.

    Attributes:
        index: Round number, from 1.
        version: Policy version the round's work items require (``min_policy_version``).
        started_at: Clock reading when the round was emitted, seconds.
        expected: Trajectories requested per group id.
        received: Trajectories received per group id (new ones only; duplicates do not count).
    """

    index: int
    version: int
    started_at: float
    expected: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)

    @property
    def requested(self) -> int:
        """Trajectories requested by the round."""
        return sum(self.expected.values())

    @property
    def missing(self) -> int:
        """Trajectories requested and not yet received."""
        return sum(max(0, n - self.received.get(gid, 0)) for gid, n in self.expected.items())

    def add_group(self, group_id: str, size: int) -> None:
        """A group of the round is about to be published."""
        self.expected[group_id] = size

    def record(self, group_id: str) -> bool:
        """A new trajectory arrived; returns whether it belongs to this round."""
        if group_id not in self.expected:
            return False
        self.received[group_id] = self.received.get(group_id, 0) + 1
        return True

    def done(self) -> bool:
        """Whether every requested trajectory arrived."""
        return self.missing == 0

    def timed_out(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> bool:
        """Whether the round has waited ``timeout_s`` since it was emitted."""
        return clock() - self.started_at >= timeout_s


class CoupledEmitter:
    """Emits rounds and holds each behind its barrier (see the module docstring).

    Example::

        emitter = CoupledEmitter(config.emission, state, bus, planner, former)
        ingestor = Ingestor(config.ingest, state, former, arrived=emitter.arrived)
        await emitter.run()
    """

    def __init__(
        self, emission: EmissionConfig, state: DataState, bus: Bus, planner: WorkPlanner, former: BatchFormer
    ) -> None:
        """Create the emitter.

        Args:
            emission: Emission settings (``emission.coupled`` for this emitter's own).
            state: The data manager's shared state (version, counters, telemetry).
            bus: A connected bus (work goes to its ``work`` stream).
            planner: Plans each group's task, size and step budget.
            former: Keeps the round's groups until the round closes (``flush_when_full=False``).
        """
        self._emission = emission
        self._state = state
        self._bus = bus
        self._planner = planner
        self._former = former
        self.outstanding = OutstandingWork(state.clock)
        self._round: CoupledRound | None = None
        self._progress = asyncio.Event()

    def arrived(self, group_id: str) -> None:
        """A new trajectory arrived (its group already handled): the barrier may open."""
        self.outstanding.received(group_id)
        if self._round is not None and self._round.record(group_id):
            self._progress.set()

    async def run(self) -> None:
        """Run rounds until ``max_groups`` groups were emitted (forever when None), or the env budget is spent."""
        emission, state = self._emission, self._state
        index = 0
        while emission.max_groups is None or self._planner.groups_planned < emission.max_groups:
            if state.env_budget_spent():
                log.info("the env budget of %d steps is spent: no more rounds", emission.max_env_steps)
                return
            index += 1
            started = state.clock()
            rnd = await self._emit_round(index)
            await self._await_round(rnd)
            collected = state.clock()
            samples, groups = await self._close_round(rnd)
            timed_out = False
            if samples:
                timed_out = not await self._await_version(rnd.version)
            if state.telemetry is not None:
                state.telemetry.event(
                    "data.round",
                    round=index,
                    version=rnd.version,
                    requested=rnd.requested,
                    lost=rnd.missing,
                    groups=groups,
                    samples=samples,
                    collect_s=round(collected - started, 3),
                    sync_s=round(state.clock() - collected, 3),
                    sync_timed_out=timed_out,
                )

    async def _emit_round(self, index: int) -> CoupledRound:
        """Plan and publish B groups at the current version (staleness 0)."""
        max_groups = self._emission.max_groups
        count = self._emission.coupled.tasks_per_round
        if max_groups is not None:
            count = min(count, max_groups - self._planner.groups_planned)
        rnd = CoupledRound(index, self._state.version, self._state.clock())
        groups = [self._planner.next_group(rnd.version, 0) for _ in range(count)]
        for items in groups:
            rnd.add_group(items[0].group_id, len(items))
        # Set before publishing: a fast runner's trajectory may arrive mid-round.
        self._round = rnd
        for items in groups:
            self.outstanding.emitted(items[0].group_id, len(items))
            await publish_work(self._state, self._bus, items)
        log.info("coupled round %d: %d work items at version %d", index, rnd.requested, rnd.version)
        return rnd

    async def _await_round(self, rnd: CoupledRound) -> None:
        """The barrier: until every trajectory of the round arrived, or ``work_timeout_s``."""
        timeout_s = self._emission.work_timeout_s
        while not rnd.done():
            remaining = timeout_s - (self._state.clock() - rnd.started_at)
            if remaining <= 0:
                log.warning("coupled round %d timed out with %d trajectories missing", rnd.index, rnd.missing)
                break
            self._progress.clear()
            await wait_event(self._progress, min(remaining, 1.0))

    async def _close_round(self, rnd: CoupledRound) -> tuple[int, int]:
        """Close the round's open groups and publish its one batch; returns (samples, groups)."""
        self._round = None
        self.outstanding.expire(0.0)  # the round's missing trajectories are lost, not awaited
        self._state.counters["rounds"] += 1
        self._state.counters["round_lost"] += rnd.missing
        await self._former.close_groups(list(rnd.expected))
        samples, groups = await self._former.flush()
        if not groups:
            log.info("coupled round %d: no group to train on, skipping training", rnd.index)
        return samples, groups

    async def _await_version(self, version: int) -> bool:
        """Wait for a model version newer than ``version``; False when it did not come in time."""
        state = self._state
        deadline = state.clock() + self._emission.coupled.sync_timeout_s
        while state.version <= version:
            remaining = deadline - state.clock()
            if remaining <= 0:
                log.warning("no model version after %d came in time; emitting at the old one", version)
                state.counters["sync_timeouts"] += 1
                return False
            state.new_version.clear()
            await wait_event(state.new_version, min(remaining, 1.0))
        return True
