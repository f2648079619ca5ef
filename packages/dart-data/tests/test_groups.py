from __future__ import annotations

import pytest

from dart.data.config import GroupingConfig
from dart.data.groups import GroupAssembler
from dart.protocol import messages as m
from dart.runtime.testing import TASK

pytestmark = pytest.mark.unit


def traj(
    tid: str,
    gid: str = "g",
    idx: int = 0,
    size: int = 4,
    reward: float = 0.0,
    version: int = 5,
    status: m.TrajectoryStatus = m.TrajectoryStatus.OK,
) -> m.Trajectory:
    return m.Trajectory(
        trajectory_id=tid,
        work_id=tid,
        task=TASK,
        group_id=gid,
        rollout_index=idx,
        group_size=size,
        status=status,
        reward=reward,
        success=reward > 0,
        min_policy_version=version,
        max_policy_version=version,
        started_at=0.0,
        finished_at=1.0,
    )


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_complete_group_emitted_once_in_rollout_order() -> None:
    asm = GroupAssembler(GroupingConfig())
    assert asm.add(traj("b", idx=1, reward=1.0), 5) == []
    assert asm.add(traj("a", idx=0), 5) == []
    assert asm.add(traj("c", idx=2), 5) == []
    ready = asm.add(traj("d", idx=3, reward=1.0), 5)
    assert len(ready) == 1 and ready[0].complete
    assert [t.trajectory_id for t in ready[0].trajectories] == ["a", "b", "c", "d"]
    assert asm.open_groups == 0
    assert asm.add(traj("e", idx=3), 5) == []
    assert asm.drops["late"] == 1


def test_zero_variance_group_dropped() -> None:
    asm = GroupAssembler(GroupingConfig())
    for i in range(3):
        asm.add(traj(f"t{i}", idx=i, size=4, reward=1.0), 5)
    assert asm.add(traj("t3", idx=3, size=4, reward=1.0), 5) == []
    assert asm.drops["zero_variance"] == 4


def test_duplicates_ignored() -> None:
    asm = GroupAssembler(GroupingConfig())
    asm.add(traj("t0", idx=0, size=2, reward=1.0), 5)
    assert asm.add(traj("t0", idx=0, size=2, reward=1.0), 5) == []
    assert asm.drops["duplicate"] == 1
    assert len(asm.add(traj("t1", idx=1, size=2), 5)) == 1


def test_staleness_limit_on_arrival_and_while_waiting() -> None:
    asm = GroupAssembler(GroupingConfig(max_staleness=2, min_group_size=2))
    assert asm.is_stale(traj("x", version=1), 4)
    assert not asm.is_stale(traj("x", version=2), 4)
    asm.add(traj("old", idx=0, size=3, version=1), 4)
    assert asm.drops["stale"] == 1
    asm.add(traj("a", idx=1, size=3, version=3, reward=1.0), 4)
    asm.poll(6)  # a's lag is now 3 > 2
    assert asm.drops["stale"] == 2
    assert asm.add(traj("b", idx=2, size=3, version=6), 6) == []  # only one usable member left
    assert asm.drops["too_small"] == 1


def test_failed_trajectories_count_toward_completion_but_are_not_trained() -> None:
    asm = GroupAssembler(GroupingConfig(min_group_size=2))
    asm.add(traj("a", idx=0, size=3, reward=1.0), 5)
    asm.add(traj("f", idx=1, size=3, status=m.TrajectoryStatus.ENV_FAILED), 5)
    ready = asm.add(traj("b", idx=2, size=3, reward=0.0), 5)
    assert len(ready) == 1 and not ready[0].complete
    assert [t.trajectory_id for t in ready[0].trajectories] == ["a", "b"]
    assert asm.drops["not_trainable"] == 1


def test_timeout_emits_partial_group() -> None:
    clock = Clock()
    asm = GroupAssembler(GroupingConfig(timeout_s=10, min_group_size=2), clock=clock)
    asm.add(traj("a", idx=0, size=8, reward=1.0), 5)
    asm.add(traj("b", idx=1, size=8, reward=0.0), 5)
    clock.t = 9.9
    assert asm.poll(5) == []
    clock.t = 10.0
    ready = asm.poll(5)
    assert len(ready) == 1 and not ready[0].complete and len(ready[0].trajectories) == 2
    assert asm.open_groups == 0


def test_a_redelivered_unusable_trajectory_counts_once_towards_closing() -> None:
    asm = GroupAssembler(GroupingConfig(min_group_size=2))
    failed = traj("f", idx=0, size=3, status=m.TrajectoryStatus.ENV_FAILED)
    asm.add(failed, 5)
    assert asm.add(failed, 5) == []  # redelivered: the same id, not a second arrival
    assert asm.drops["duplicate"] == 1
    # Two of three arrived: the group stays open for its last member instead of closing too small.
    assert asm.add(traj("a", idx=1, size=3, reward=1.0), 5) == []
    assert asm.open_groups == 1
    ready = asm.add(traj("b", idx=2, size=3), 5)
    assert [t.trajectory_id for t in ready[0].trajectories] == ["a", "b"] and not ready[0].complete


def _steps(n: int) -> list[m.StepRecord]:
    shown = m.Observation(text="screen")
    return [m.StepRecord(index=i, policy_version=5, observation=shown, parse_error="none") for i in range(n)]


def test_a_group_of_long_episodes_waits_for_its_slowest_members() -> None:
    """30-step desktop episodes at 20 s a step: an incomplete group waits 2 x 30 x 20 s = 1200 s, not the
    300 s of timeout_s, so a failure that ran to the budget (10 minutes) is still a member."""
    desktop = TASK.model_copy(update={"max_steps": 30})
    clock = Clock()
    asm = GroupAssembler(GroupingConfig(timeout_s=300, min_group_size=2), clock=clock)
    assert asm.wait_s(30) == 300  # nothing measured yet

    def long(tid: str, idx: int, steps: int, reward: float) -> m.Trajectory:
        t = traj(tid, idx=idx, size=3, reward=reward).model_copy(update={"task": desktop, "steps": _steps(steps)})
        return t.model_copy(update={"finished_at": 20.0 * steps})

    asm.add(long("quick-success", 0, 5, 1.0), 5)
    assert asm.wait_s(30) == 1200
    clock.t = 600.0
    assert asm.poll(5) == []
    asm.add(long("slow-failure", 1, 30, 0.0), 5)
    clock.t = 1199.0
    assert asm.poll(5) == [] and asm.drops["late"] == 0
    clock.t = 1200.0
    ready = asm.poll(5)
    assert [t.trajectory_id for t in ready[0].trajectories] == ["quick-success", "slow-failure"]
    # Short tasks keep timeout_s; episode_slack 0 turns the stretching off.
    assert asm.wait_s(3) == 300
    assert GroupAssembler(GroupingConfig(timeout_s=300, episode_slack=0)).wait_s(30) == 300
