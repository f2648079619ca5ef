"""Branching rollouts in the data manager: branch points, sibling advantages, and the flow over a real bus.

The flow test runs the data service against a real nats-server and a real env service (the sim, which forks;
a sim that says it does not), and plays the rollout service's part by answering the work items it emits.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dart.data.advantages import step_advantages
from dart.data.branching import branch_points, branch_spec, uncertainty
from dart.data.config import (
    BatchingConfig,
    BranchingConfig,
    CurationConfig,
    DataConfig,
    DecoupledConfig,
    EmissionConfig,
    GroupingConfig,
)
from dart.data.service import DataService
from dart.env.interface import ENV_BACKENDS
from dart.env.service import EnvService, EnvServiceConfig
from dart.env.sim import LatencyConfig, SimConfig, SimEnv
from dart.protocol import messages as m
from dart.runtime.bus import Bus
from dart.runtime.store import LocalStore
from dart.runtime.testing import TASK, tiny_png, wait_until
from dart.runtime.topology import durable_name

R2 = math.sqrt(2.0)


MakeTraj = Callable[..., m.Trajectory]
MakeStep = Callable[..., m.StepRecord]


@pytest.fixture
def branch_factory(step_factory: MakeStep) -> Callable[..., m.Trajectory]:
    return lambda *args, **kwargs: branch_traj(step_factory, *args, **kwargs)


def branch_traj(
    make_step: MakeStep, tid: str, parent: m.Trajectory, step: int, reward: float, *, work_id: str, steps: int = 4
) -> m.Trajectory:
    """A forked continuation of ``parent`` from ``step`` (its steps numbered from there)."""
    return m.Trajectory(
        trajectory_id=tid,
        work_id=work_id,
        task=parent.task,
        group_id=parent.group_id,
        rollout_index=parent.rollout_index,
        group_size=parent.group_size,
        steps=[make_step(i, 3, shot=i) for i in range(step, steps)],
        status=m.TrajectoryStatus.TRUNCATED,
        reward=reward,
        success=reward > 0,
        min_policy_version=3,
        max_policy_version=3,
        started_at=20.0,
        finished_at=21.0,
        branch=m.BranchOrigin(parent_trajectory_id=parent.trajectory_id, step_index=step),
    )


def test_branch_points_are_the_most_uncertain_steps_after_min_step(traj_factory: MakeTraj) -> None:
    traj = traj_factory("t", steps=6, entropies=[3.0, 0.2, 0.9, 0.1, 0.9, 0.5])
    assert branch_points(traj, BranchingConfig(max_points=2)) == [2, 4]  # step 0 is never one; ties: earlier
    assert branch_points(traj, BranchingConfig(max_points=1)) == [2]
    assert branch_points(traj, BranchingConfig(max_points=3, min_step=3)) == [3, 4, 5]
    # Only steps at or above the 60 % quantile of all six (0.66): 2 and 4 (0.9), not 5 (0.5).
    assert branch_points(traj, BranchingConfig(max_points=4, min_quantile=0.6)) == [2, 4]
    # Without recorded entropies (vLLM) the mean surprisal ranks the steps: the make_step log-probs fall with
    # the index, so the last step is the least sure.
    plain = traj.model_copy(update={"steps": [s.model_copy(update={"response_entropy": []}) for s in traj.steps]})
    assert uncertainty(plain.steps[5]) == pytest.approx(0.6) and branch_points(plain, BranchingConfig()) == [5]


def test_a_branch_spec_carries_the_prefix_and_the_screens_the_replay_passes(traj_factory: MakeTraj) -> None:
    traj = traj_factory("t", steps=4)
    no_action = traj.steps[1].model_copy(update={"action": None, "parse_error": "no action"})
    traj = traj.model_copy(update={"steps": [traj.steps[0], no_action, *traj.steps[2:]]})
    spec = branch_spec(traj, 3)
    digests = [hashlib.sha256(tiny_png(i + 2, 2)).hexdigest() for i in range(4)]
    assert [p.screenshot_sha256 for p in spec.prefix] == digests[:3] and spec.screenshot_sha256 == digests[3]
    assert [p.action is None for p in spec.prefix] == [False, True, False]
    # The replay runs the two actions: the screens after the reset (step 0's), after step 0's action (the one step
    # 1 acted on) and after step 2's (the one at the branch point).
    assert len(spec.actions) == 2 and spec.screens == [digests[0], digests[1], digests[3]]
    with pytest.raises(ValueError, match="no step 4"):
        branch_spec(traj, 4)
    with pytest.raises(ValueError, match="no step 0"):
        branch_spec(traj, 0)


def test_sibling_advantages_credit_the_steps_from_the_branch_point(
    traj_factory: MakeTraj, branch_factory: MakeTraj
) -> None:
    make_traj, branch_traj = traj_factory, branch_factory
    a = make_traj("a", idx=0, reward=0.0, steps=4)
    b = make_traj("b", idx=1, reward=1.0, steps=4)
    a1 = branch_traj("a1", a, 2, 1.0, work_id="w-a-b2-0")
    a2 = branch_traj("a2", a, 2, 1.0, work_id="w-a-b2-1")
    b1 = branch_traj("b1", b, 2, 1.0, work_id="w-b-b2-0")
    adv = step_advantages([a, b, a1, a2, b1], eps=1e-9)
    # The rollouts a (0) and b (1) keep the group's baseline before the branch point...
    assert adv["a"][:2] == pytest.approx([-1.0, -1.0]) and adv["b"][:2] == pytest.approx([1.0, 1.0])
    # ...and from it on are credited against their siblings there: a (0) among a1, a2 (1, 1); b and b1 agree.
    assert adv["a"][2:] == pytest.approx([-R2, -R2]) and adv["b"][2:] == pytest.approx([0.0, 0.0])
    assert adv["a1"] == pytest.approx([1 / R2] * 2) and adv["a2"] == adv["a1"] and adv["b1"] == pytest.approx([0, 0])
    # A branch whose parent is not in the group is compared with the rollouts' statistics (mean 0.5, std 0.5).
    lone = step_advantages([a, b, branch_traj("x", make_traj("gone"), 2, 1.0, work_id="w-x")], eps=1e-9)
    assert lone["x"] == pytest.approx([1.0, 1.0]) and lone["a"] == pytest.approx([-1.0] * 4)
    # Without branches: GRPO, step-wise.
    assert step_advantages([a, b], scale_by_std=False) == {"a": [-0.5] * 4, "b": [0.5] * 4}


class SimWithoutFork(SimEnv):
    forks = False


@pytest.fixture(autouse=True)
def _no_fork_backend() -> Iterator[None]:
    ENV_BACKENDS.register("sim-no-fork-data", lambda cfg, stream: SimWithoutFork(cfg.sim, stream=stream), replace=True)
    yield
    ENV_BACKENDS.unregister("sim-no-fork-data")


def branching_config(tmp_path: Path, pool: str) -> DataConfig:
    return DataConfig(
        database_url=f"sqlite:///{tmp_path / 'data.sqlite3'}",
        env_pool=pool,
        grouping=GroupingConfig(timeout_s=60, poll_interval_s=0.05),
        curation=CurationConfig(
            dynamic_rollouts=False,
            default_rollouts=2,
            dynamic_max_steps=False,
            experience_pool=False,
            branching=BranchingConfig(enabled=True, max_points=1, continuations=2),
        ),
        emission=EmissionConfig(max_groups=1, decoupled=DecoupledConfig(max_outstanding=2, poll_interval_s=0.05)),
        batching=BatchingConfig(min_samples=64, max_groups=1),
    )


@pytest.mark.integration
async def test_rollouts_are_branched_and_their_group_waits_for_the_branches(
    bus: Bus, tmp_path: Path, traj_factory: MakeTraj, branch_factory: MakeTraj
) -> None:
    make_traj, branch_traj = traj_factory, branch_factory
    fast = SimConfig(latency=LatencyConfig(scale=0.0))
    async with EnvService(EnvServiceConfig(pool=f"p{uuid.uuid4().hex[:8]}", sim=fast), bus) as env:
        config = branching_config(tmp_path, env.config.pool)
        service = DataService(config, bus, LocalStore(tmp_path / "store"), [TASK])
        runner = await bus.pull_consumer("work", durable_name(bus, "work"), m.WorkItem)
        trainer = await bus.pull_consumer("batch", durable_name(bus, "batch"), m.TrainingBatch)
        subject = bus.subjects.stream_subject("traj")
        async with service:
            await wait_until(lambda: service.brancher.forks is True and service.stats.work_items == 2)
            roots = [d.message for d in await runner.fetch(2, timeout=10)]
            assert [w.branch for w in roots] == [None, None]
            entropies = [0.1, 0.2, 0.9, 0.3]  # step 2 is where the policy was least sure
            a = make_traj("a", roots[0].group_id, 0, reward=0.0, steps=4, entropies=entropies, work_id=roots[0].work_id)
            b = make_traj("b", roots[1].group_id, 1, reward=1.0, steps=4, entropies=entropies, work_id=roots[1].work_id)
            for t in (a, b):
                await bus.js_publish(subject, t, msg_id=t.trajectory_id)
            await wait_until(lambda: service.stats.branches == 4)
            branches = [d.message for d in await runner.fetch(4, timeout=10)]
            # Both rollouts are in, but the group waits for its four branches: no batch yet.
            assert service.former.groups.open_groups == 1 and (await bus.stream_state("batch")).messages == 0
            assert service.stats.outstanding == 4
            by_parent = {(w.branch.parent_trajectory_id, w.rollout_index) for w in branches if w.branch is not None}
            assert by_parent == {("a", 0), ("b", 1)}
            for w in branches:
                assert w.branch is not None and w.branch.step_index == 2 and w.group_id == a.group_id
                assert w.branch.screens == [hashlib.sha256(tiny_png(i + 2, 2)).hexdigest() for i in range(3)]
                assert w.work_id.startswith(f"{w.branch.parent_work_id}-b2-") and w.max_steps == TASK.max_steps
            of = {(w.branch.parent_trajectory_id if w.branch else "", w.work_id[-1]): w for w in branches}
            answers = [
                branch_traj("a1", a, 2, 1.0, work_id=of[("a", "0")].work_id),
                branch_traj("a2", a, 2, 1.0, work_id=of[("a", "1")].work_id),
                branch_traj("b1", b, 2, 1.0, work_id=of[("b", "0")].work_id),
                # The env refused this fork: the work is answered as a normal rollout, which says why.
                make_traj("b2", a.group_id, 1, reward=0.0, steps=4, work_id=of[("b", "1")].work_id).model_copy(
                    update={"branch_refused": "fork_mismatch"}
                ),
            ]
            for t in answers:
                await bus.js_publish(subject, t, msg_id=t.trajectory_id)
            [delivery] = await trainer.fetch(1, timeout=10)
            batch = delivery.message
            await delivery.ack()
            await wait_until(lambda: service.stats.batches == 1)
            stats = service.stats
            row = service.state.index.trajectory("a1")
        await trainer.close()
        await runner.close()
    assert stats.branches == 4 and stats.branches_refused == {"fork_mismatch": 1} and stats.forks is True
    # Env steps: the rollouts' 4 + 4, the branches' 2 + 2 + 2, the refused one's 4, and 2 replayed actions a fork.
    assert stats.env_steps == 8 + 6 + 4 + 4 * 2
    assert stats.outstanding == 0
    # Only the rollouts (the refused branch is one) count in the task's statistics.
    assert service.state.task_stats[TASK.task_id].attempts == 3
    assert row is not None and (row["parent_trajectory_id"], row["branch_step"]) == ("a", 2)
    advantage = {(s.trajectory_id, s.step_index): s.advantage for s in batch.samples}
    assert len(advantage) == 4 + 4 + 2 + 2 + 2 + 4
    # Rollouts a (0), b (1), b2 (0): mean 1/3, std sqrt(2)/3, before the branch point.
    assert [advantage[("a", i)] for i in range(2)] == pytest.approx([-1 / R2] * 2, abs=1e-5)
    assert [advantage[("b", i)] for i in range(2)] == pytest.approx([R2] * 2, abs=1e-5)
    assert [advantage[("b2", i)] for i in range(4)] == pytest.approx([-1 / R2] * 4, abs=1e-5)
    # From step 2: a (0) among its siblings a1, a2 (1, 1); b and b1 (1, 1) agree, so nothing to learn there.
    assert [advantage[("a", i)] for i in (2, 3)] == pytest.approx([-R2] * 2, abs=1e-5)
    assert [advantage[(t, i)] for t in ("a1", "a2") for i in (2, 3)] == pytest.approx([1 / R2] * 4, abs=1e-5)
    assert [advantage[(t, i)] for t in ("b", "b1") for i in (2, 3)] == pytest.approx([0.0] * 4, abs=1e-5)


@pytest.mark.integration
async def test_a_pool_that_does_not_fork_gets_no_branches(bus: Bus, tmp_path: Path, traj_factory: MakeTraj) -> None:
    make_traj = traj_factory
    pool = f"p{uuid.uuid4().hex[:8]}"
    async with EnvService(EnvServiceConfig(pool=pool, backend="sim-no-fork-data"), bus):
        service = DataService(branching_config(tmp_path, pool), bus, LocalStore(tmp_path / "store"), [TASK])
        runner = await bus.pull_consumer("work", durable_name(bus, "work"), m.WorkItem)
        trainer = await bus.pull_consumer("batch", durable_name(bus, "batch"), m.TrainingBatch)
        subject = bus.subjects.stream_subject("traj")
        async with service:
            await wait_until(lambda: service.brancher.forks is False and service.stats.work_items == 2)
            roots = [d.message for d in await runner.fetch(2, timeout=10)]
            for i, (w, reward) in enumerate(zip(roots, (0.0, 1.0), strict=True)):
                t = make_traj(f"t{i}", w.group_id, w.rollout_index, reward=reward, steps=4, work_id=w.work_id)
                await bus.js_publish(subject, t, msg_id=t.trajectory_id)
            [delivery] = await trainer.fetch(1, timeout=10)  # the group closes on its two rollouts
            await delivery.ack()
            assert service.stats.branches == 0 and service.stats.work_items == 2
        await trainer.close()
        await runner.close()


@pytest.mark.integration
async def test_an_env_step_budget_stops_emission_once_spent(bus: Bus, tmp_path: Path, traj_factory: MakeTraj) -> None:
    """``emission.max_env_steps``: once the stored trajectories took the budget, no more work is emitted, though
    the outstanding account has room."""
    config = DataConfig(
        database_url=f"sqlite:///{tmp_path / 'data.sqlite3'}",
        curation=CurationConfig(dynamic_rollouts=False, default_rollouts=2),
        emission=EmissionConfig(max_env_steps=5, decoupled=DecoupledConfig(max_outstanding=2, poll_interval_s=0.05)),
        grouping=GroupingConfig(timeout_s=60, poll_interval_s=0.05),
    )
    service = DataService(config, bus, LocalStore(tmp_path / "store"), [TASK])
    runner = await bus.pull_consumer("work", durable_name(bus, "work"), m.WorkItem)
    subject = bus.subjects.stream_subject("traj")
    async with service:
        (emit,) = [t for t in service._tasks if t.get_name() == "dart-data-emit"]
        for round_ in range(2):  # 2 x 2 rollouts of 2 steps: 8 env steps, the budget of 5 spent in round 2
            await wait_until(lambda r=round_: service.stats.work_items == 2 * (r + 1))
            for w in [d.message for d in await runner.fetch(2, timeout=10)]:
                t = traj_factory(
                    f"t{w.work_id}", w.group_id, w.rollout_index, reward=float(w.rollout_index), work_id=w.work_id
                )
                await bus.js_publish(subject, t, msg_id=t.trajectory_id)
            await wait_until(lambda r=round_: service.stats.stored == 2 * (r + 1))
        await wait_until(emit.done)
        assert service.stats.env_steps == 8 and service.stats.work_items == 4 and service.stats.outstanding == 0
    await runner.close()
