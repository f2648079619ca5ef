"""Adaptive data curation: what to roll out next and which data to train on.

Four features, each switchable in :class:`~dart.data.config.CurationConfig`:

* dynamic rollout count: GRPO learns most from tasks whose group rewards vary, so tasks with a
  success rate near 0.5 get up to ``max_rollouts`` and solved or hopeless ones ``min_rollouts``;
* dynamic step budget: a task's longest recent success plus a margin, so easy tasks do not burn
  environment time on long failing tails;
* experience pool: successes of hard tasks are kept and fill an all-failure group of the same
  task, which otherwise has zero advantage everywhere and teaches nothing;
* high-entropy step selection: only the top fraction of steps by mean token entropy is trained on
  (the decision points; low-entropy steps carry little gradient).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from dart.data.config import CurationConfig
from dart.data.stats import TaskStats
from dart.protocol.messages import TaskSpec, Trajectory


def rollout_count(stats: TaskStats | None, config: CurationConfig) -> int:
    """Rollouts for the next group of a task.

    Scales with the Bernoulli variance ``p (1 - p)`` of the task's recent success rate ``p``:
    ``min + (max - min) * 4 p (1 - p)``, rounded; ``default_rollouts`` until the task has
    ``min_attempts`` attempts or when the feature is off.
    """
    if not config.dynamic_rollouts or stats is None or stats.attempts < config.min_attempts:
        return config.default_rollouts
    p = stats.success_rate
    spread = config.max_rollouts - config.min_rollouts
    return config.min_rollouts + round(spread * 4 * p * (1 - p))


def max_steps_for(task: TaskSpec, stats: TaskStats | None, config: CurationConfig) -> int:
    """Step budget for the next rollouts of a task.

    ``ceil(longest recent success * (1 + margin))`` clamped to ``[max_steps_floor, ceiling]``,
    where the ceiling is ``max_steps_ceiling`` or else the task's own ``max_steps``; the task's
    ``max_steps`` (clamped the same way) while it has no recent success or the feature is off.
    """
    ceiling = config.max_steps_ceiling or task.max_steps
    floor = min(config.max_steps_floor, ceiling)
    if not config.dynamic_max_steps or stats is None or not stats.success_lengths:
        return max(floor, min(task.max_steps, ceiling))
    budget = math.ceil(max(stats.success_lengths) * (1 + config.max_steps_margin))
    return max(floor, min(budget, ceiling))


def is_hard(stats: TaskStats | None, config: CurationConfig) -> bool:
    """Whether a task's success rate is below ``hard_task_threshold`` (an unseen task is hard)."""
    return stats is None or stats.success_rate < config.hard_task_threshold


class ExperiencePool:
    """Stored successes of hard tasks, newest first, at most ``pool_size_per_task`` per task.

    Lifecycle of an entry: ``added`` when a successful trajectory of a hard task is stored ->
    ``served`` (any number of times, round robin) to fill all-failure groups of its task ->
    ``evicted`` when newer successes push it out. The durable copy is the ``pooled`` flag in the
    index plus the blob; this in-memory mirror is rebuilt from them at start.
    """

    def __init__(self, config: CurationConfig) -> None:
        self.config = config
        self._entries: dict[str, deque[Trajectory]] = {}
        self._turn: dict[str, int] = {}
        self.served = 0

    def add(self, traj: Trajectory) -> None:
        """Pool a (stored, ImageRef'd) successful trajectory; the oldest of its task may leave."""
        entries = self._entries.setdefault(traj.task.task_id, deque(maxlen=self.config.pool_size_per_task))
        if all(t.trajectory_id != traj.trajectory_id for t in entries):
            entries.appendleft(traj)

    def should_pool(self, traj: Trajectory, stats: TaskStats | None) -> bool:
        """Whether a just-stored trajectory belongs in the pool."""
        return (
            self.config.experience_pool
            and traj.trainable
            and traj.success
            and traj.branch is None  # a branch's success is its parent's prefix's too
            and is_hard(stats, self.config)
        )

    def fill(self, members: Sequence[Trajectory], stats: TaskStats | None) -> Trajectory | None:
        """A pooled success for a group that has none, when its task is hard; else None."""
        if not self.config.experience_pool or not members or any(t.success for t in members):
            return None
        if not is_hard(stats, self.config):
            return None
        entries = self._entries.get(members[0].task.task_id)
        if not entries:
            return None
        turn = self._turn.get(members[0].task.task_id, 0)
        self._turn[members[0].task.task_id] = turn + 1
        self.served += 1
        return entries[turn % len(entries)]

    def size(self, task_id: str | None = None) -> int:
        """Entries of one task, or of all tasks."""
        if task_id is not None:
            return len(self._entries.get(task_id, ()))
        return sum(len(e) for e in self._entries.values())
