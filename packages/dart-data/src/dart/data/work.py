"""Work planning and the outstanding-work account behind backpressure.

The emitter keeps ``outstanding`` (trajectories requested but not yet received) at or below
``max_outstanding``: enough to keep every rollout runner busy, few enough that a new policy
version reaches the work queue quickly (work queued long ago would be sampled by then-stale
policies' successors anyway, but its group sizes and step budgets were decided on old statistics).

Work-group lifecycle in the account: ``emitted`` (all its work items published; ``group_size``
outstanding) -> each received trajectory removes one -> ``settled`` when all arrived, or
``expired`` ``work_timeout_s`` after emission (the missing ones stop counting: a runner that gave
up for good must not stall emission forever).

Task order: the planner walks the task list in passes, each pass a fresh permutation drawn from
``emission.seed`` and the pass number, so every task gets one group per pass while consecutive
groups (and so the groups in flight and in each batch) mix the suite's families; suites are
written grouped by family, and walking them in order made the work of a whole minute come from one
family. The order is a function of the seed alone: a restarted data manager starts again at the
first pass's permutation (its planning position is not persisted), so the tasks planned early in
the interrupted pass get a group more than the rest, at most one pass's worth of imbalance.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dart.data.config import CurationConfig, EmissionConfig
from dart.data.curation import max_steps_for, rollout_count
from dart.data.stats import TaskStats
from dart.protocol.messages import TaskSpec, WorkItem


@dataclass
class _Pending:
    missing: int
    emitted_at: float


class OutstandingWork:
    """Trajectories requested and not yet received, per work group."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._groups: dict[str, _Pending] = {}
        self.expired = 0

    @property
    def count(self) -> int:
        """Outstanding trajectories."""
        return sum(p.missing for p in self._groups.values())

    def emitted(self, group_id: str, size: int) -> None:
        """A group's work items were published."""
        self._groups[group_id] = _Pending(size, self._clock())

    def add(self, group_id: str, count: int) -> None:
        """More trajectories of a group were requested (its rollouts' branches)."""
        pending = self._groups.get(group_id)
        if pending is None:
            self._groups[group_id] = _Pending(count, self._clock())
        else:
            pending.missing += count

    def received(self, group_id: str) -> bool:
        """A new trajectory arrived; returns whether it was one this account waited for."""
        pending = self._groups.get(group_id)
        if pending is None:
            return False
        pending.missing -= 1
        if pending.missing <= 0:
            del self._groups[group_id]
        return True

    def oldest_age(self, within_s: float) -> float:
        """Seconds since the oldest group still awaited was emitted, 0.0 when none is; a group emitted
        ``within_s`` or more ago counts as written off (what :meth:`expire` does to it when next called)."""
        now = self._clock()
        return max((age for p in self._groups.values() if (age := now - p.emitted_at) < within_s), default=0.0)

    def expire(self, timeout_s: float) -> int:
        """Forget groups emitted more than ``timeout_s`` ago; returns the trajectories written off."""
        now = self._clock()
        old = [gid for gid, p in self._groups.items() if now - p.emitted_at >= timeout_s]
        lost = sum(self._groups.pop(gid).missing for gid in old)
        self.expired += lost
        return lost


def min_policy_version(current_version: int, max_staleness: int | None) -> int:
    """Oldest policy a runner may sample with: older ones would produce data the group assembler
    rejects as stale anyway."""
    return 0 if max_staleness is None else max(0, current_version - max_staleness)


class WorkPlanner:
    """Plans work groups, walking the task list in passes of seeded shuffles.

    Each group is one task x its current rollout count, with the task's current step budget.
    Pass ``p`` visits every task once, in the order of ``random.Random(f"{seed}/{p}")``'s shuffle of
    the task list: deterministic given ``emission.seed``, a different permutation each pass.
    """

    def __init__(
        self,
        tasks: Sequence[TaskSpec],
        curation: CurationConfig,
        emission: EmissionConfig,
        stats: Mapping[str, TaskStats],
    ) -> None:
        """Create a planner.

        Args:
            tasks: The task list (a suite); its order does not matter (each pass shuffles it).
            curation: Rollout-count and step-budget rules.
            emission: Temperature and limits.
            stats: Live per-task statistics (read at planning time).
        """
        if not tasks:
            raise ValueError("the task list is empty: give the data service at least one TaskSpec")
        self.tasks = list(tasks)
        self.curation = curation
        self.emission = emission
        self.stats = stats
        self.groups_planned = 0
        self._pass: list[TaskSpec] = []

    def pass_order(self, index: int) -> list[TaskSpec]:
        """The tasks of pass ``index`` in the order they are planned."""
        order = list(self.tasks)
        random.Random(f"{self.emission.seed}/{index}").shuffle(order)
        return order

    def next_task(self) -> TaskSpec:
        """The task of the next group (advances the plan)."""
        position = self.groups_planned % len(self.tasks)
        if position == 0:
            self._pass = self.pass_order(self.groups_planned // len(self.tasks))
        self.groups_planned += 1
        return self._pass[position]

    def next_group(self, current_version: int, max_staleness: int | None) -> list[WorkItem]:
        """The work items of the next group."""
        task = self.next_task()
        stats = self.stats.get(task.task_id)
        size = rollout_count(stats, self.curation)
        steps = max_steps_for(task, stats, self.curation)
        min_version = min_policy_version(current_version, max_staleness)
        group_id = f"g-{uuid.uuid4().hex[:16]}"
        now = time.time()
        return [
            WorkItem(
                work_id=f"{group_id}-{i}",
                task=task,
                group_id=group_id,
                rollout_index=i,
                group_size=size,
                max_steps=steps,
                min_policy_version=min_version,
                sampling=self.emission.sampling,
                created_at=now,
            )
            for i in range(size)
        ]
