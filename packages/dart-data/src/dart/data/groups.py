"""GRPO group formation with staleness and variance filters.

Group lifecycle: ``open`` when its first trajectory arrives -> ``complete`` when ``group_size`` distinct
trajectories arrived (by id, usable or not: a redelivered one counts once), or ``timed out`` when its wait
passed since the first one (then it is emitted if it has at least ``min_group_size`` usable members, else
dropped) -> emitted or dropped, never both. A group whose rollouts are branched (:mod:`dart.data.branching`)
also waits for the branches, its wait counted again from their emission. The wait is ``timeout_s``, or longer
where the task's episodes may take longer: ``episode_slack`` times its step budget times the observed seconds
per step (the 90th percentile of the last :data:`STEP_TIME_WINDOW` trajectories that took steps), so a 30-step
desktop task whose steps take 20 s waits 20 minutes for its slowest members. Just before that decision, a
group none of whose members succeeded may be filled with one stored success of the same task (the experience
pool, through the ``fill`` hook). A trajectory is usable when its status is trainable and its policy lag
(``current_version - min_policy_version``) is within ``max_staleness``.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dart.data.advantages import has_variance
from dart.data.config import GroupingConfig
from dart.protocol.messages import Trajectory

STEP_TIME_WINDOW = 64
"""Recent trajectories whose seconds per step estimate how long an episode takes."""


@dataclass
class ReadyGroup:
    """A group ready for advantage computation."""

    group_id: str
    trajectories: list[Trajectory]
    complete: bool
    """False when emitted on timeout with fewer members than requested."""
    pooled: frozenset[str] = frozenset()
    """Ids of members injected from the experience pool (not rolled out for this group)."""


@dataclass
class _OpenGroup:
    expected: int
    first_seen: float
    task_id: str
    budget: int
    """The task's step budget."""
    members: dict[str, Trajectory] = field(default_factory=dict)
    """Usable members by trajectory id."""
    seen: set[str] = field(default_factory=set)
    """Every trajectory id that arrived, usable or not: a redelivery of any of them counts once."""

    @property
    def unusable(self) -> int:
        """Arrivals that are not (or no longer) members: not trainable, or stale."""
        return len(self.seen) - len(self.members)


class GroupAssembler:
    """Collects trajectories into GRPO groups and applies the staleness and variance filters.

    Not thread-safe; owned by one task of the data manager. ``drops`` counts why data was
    discarded (``stale``, ``not_trainable``, ``zero_variance``, ``too_small``, ``duplicate``).
    """

    def __init__(
        self,
        policy: GroupingConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        fill: Callable[[str, list[Trajectory]], Trajectory | None] | None = None,
        on_drop: Callable[[str, str, str], None] | None = None,
    ) -> None:
        """Create an assembler.

        Args:
            policy: Completion, timeout, staleness and variance rules (``data.grouping``).
            clock: Monotonic seconds (injectable for tests).
            fill: Called as ``fill(group_id, members)`` when a closing group has no successful
                member; may return a stored success of the same task to add (experience pool).
            on_drop: Called as ``on_drop(group_id, task_id, reason)`` when a group is dropped.
        """
        self.policy = policy
        self._clock = clock
        self._fill = fill
        self._on_drop = on_drop
        self._open: dict[str, _OpenGroup] = {}
        self._closed: set[str] = set()
        self._step_s: deque[float] = deque(maxlen=STEP_TIME_WINDOW)
        self.drops: Counter[str] = Counter()

    def is_stale(self, traj: Trajectory, current_version: int) -> bool:
        """Whether a trajectory's oldest step lags the current policy by more than allowed."""
        limit = self.policy.max_staleness
        return limit is not None and current_version - traj.min_policy_version > limit

    def add(self, traj: Trajectory, current_version: int, *, branches: int = 0) -> list[ReadyGroup]:
        """Add one trajectory; return the groups that became ready (at most one).

        Args:
            traj: The trajectory.
            current_version: The newest policy version (staleness).
            branches: Branches of ``traj`` just emitted (:mod:`dart.data.branching`): the group waits for them
                too, its wait counted again from now. Ignored for a trajectory the group has seen.
        """
        if traj.group_id in self._closed:
            self.drops["late"] += 1
            return []
        group = self._open.setdefault(
            traj.group_id, _OpenGroup(traj.group_size, self._clock(), traj.task.task_id, traj.task.max_steps)
        )
        if traj.steps and traj.finished_at > traj.started_at:
            self._step_s.append((traj.finished_at - traj.started_at) / len(traj.steps))
        if traj.trajectory_id in group.seen:
            self.drops["duplicate"] += 1
            return []
        group.seen.add(traj.trajectory_id)
        if branches:
            group.expected += branches
            group.first_seen = self._clock()  # the branches start now: their episodes get the whole wait
        if not traj.trainable:
            self.drops["not_trainable"] += 1
        elif self.is_stale(traj, current_version):
            self.drops["stale"] += 1
        else:
            group.members[traj.trajectory_id] = traj
        if len(group.seen) >= group.expected:
            return self._close(traj.group_id, complete=group.unusable == 0)
        return []

    def poll(self, current_version: int) -> list[ReadyGroup]:
        """Close groups that timed out, and drop members that went stale while waiting."""
        ready: list[ReadyGroup] = []
        now = self._clock()
        step_s = self._step_time()  # once per poll, not per open group
        for gid, group in list(self._open.items()):
            for tid, traj in list(group.members.items()):
                if self.is_stale(traj, current_version):
                    del group.members[tid]
                    self.drops["stale"] += 1
            if now - group.first_seen >= self._wait(group.budget, step_s):
                ready.extend(self._close(gid, complete=False))
        return ready

    def wait_s(self, budget: int) -> float:
        """How long an incomplete group of a task with step budget ``budget`` waits for its members, seconds."""
        return self._wait(budget, self._step_time())

    def _wait(self, budget: int, step_s: float | None) -> float:
        if step_s is None or self.policy.episode_slack == 0:
            return self.policy.timeout_s
        return max(self.policy.timeout_s, self.policy.episode_slack * budget * step_s)

    def _step_time(self) -> float | None:
        """The 90th percentile of recent trajectories' seconds per step; None before any was seen."""
        if not self._step_s:
            return None
        ordered = sorted(self._step_s)
        return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]

    def close(self, gid: str) -> list[ReadyGroup]:
        """Close one group now with the members it has (coupled mode's round timeout).

        Returns:
            The group when it passes the filters; nothing when it is not open (never seen, or
            already closed) or is dropped.
        """
        if gid not in self._open:
            return []
        return self._close(gid, complete=False)

    def closed(self, gid: str) -> bool:
        """Whether a group was emitted or dropped already (a member arriving now is late)."""
        return gid in self._closed

    @property
    def open_groups(self) -> int:
        """Number of groups still waiting for members."""
        return len(self._open)

    def _close(self, gid: str, complete: bool) -> list[ReadyGroup]:
        group = self._open.pop(gid)
        self._closed.add(gid)
        members = sorted(group.members.values(), key=lambda t: (t.rollout_index, t.first_step, t.trajectory_id))
        pooled: frozenset[str] = frozenset()
        if members and self._fill is not None and not any(t.success for t in members):
            extra = self._fill(gid, members)
            if extra is not None and extra.trajectory_id not in group.members:
                members.append(extra)
                pooled = frozenset({extra.trajectory_id})
        if len(members) < self.policy.min_group_size:
            self.drops["too_small"] += len(members) or 1
            self._dropped(gid, group.task_id, "too_small")
            return []
        rewards = [t.reward for t in members]
        if self.policy.drop_zero_variance and not has_variance(rewards):
            self.drops["zero_variance"] += len(members)
            self._dropped(gid, group.task_id, "zero_variance")
            return []
        return [ReadyGroup(gid, members, complete, pooled)]

    def _dropped(self, gid: str, task_id: str, reason: str) -> None:
        if self._on_drop is not None:
            self._on_drop(gid, task_id, reason)
