from __future__ import annotations

from pathlib import Path

import pytest

from dart.data.advantages import group_advantages
from dart.data.batches import BatchAssembler, group_samples
from dart.data.blobs import TrajectoryBlobs
from dart.data.config import BatchingConfig, CurationConfig, EmissionConfig, GroupingConfig
from dart.data.curation import ExperiencePool, is_hard, max_steps_for, rollout_count
from dart.data.groups import GroupAssembler, ReadyGroup
from dart.data.stats import TaskStats
from dart.data.tasks import load_task_suite
from dart.data.work import OutstandingWork, WorkPlanner
from dart.protocol import messages as m
from dart.protocol.errors import SuiteError
from dart.runtime.store import LocalStore
from dart.runtime.testing import SHA, TASK

pytestmark = pytest.mark.unit


def stats_with(successes: int, attempts: int, lengths: tuple[int, ...] = ()) -> TaskStats:
    s = TaskStats(TASK.task_id)
    for i in range(attempts):
        ok = i < successes
        s = s.recorded(ok, lengths[i] if ok and i < len(lengths) else 3, window=32)
    return s


def test_task_stats_window_and_ema() -> None:
    s = TaskStats("t")
    for ok in [True, False, False, True, True]:
        s = s.recorded(ok, 4, window=3)
    assert (s.attempts, s.successes) == (5, 3)
    assert s.recent == (0, 1, 1) and s.success_rate == pytest.approx(2 / 3)
    assert s.success_lengths == (4, 4, 4) and 0 < s.ema_success < 1
    assert TaskStats.from_row(s.to_row()) == s


def test_rollout_count_peaks_at_mid_success_and_respects_bounds() -> None:
    cfg = CurationConfig(min_rollouts=2, max_rollouts=10, default_rollouts=6, min_attempts=4)
    assert rollout_count(None, cfg) == 6
    assert rollout_count(stats_with(1, 3), cfg) == 6  # too little history
    assert rollout_count(stats_with(4, 8), cfg) == 10  # p = 0.5
    assert rollout_count(stats_with(8, 8), cfg) == 2  # solved
    assert rollout_count(stats_with(0, 8), cfg) == 2  # hopeless
    assert 2 < rollout_count(stats_with(2, 8), cfg) < 10
    off = cfg.model_copy(update={"dynamic_rollouts": False})
    assert rollout_count(stats_with(8, 8), off) == 6
    with pytest.raises(ValueError, match="min_rollouts"):
        CurationConfig(min_rollouts=9, max_rollouts=8)


def test_max_steps_from_successful_lengths_within_bounds() -> None:
    task = TASK.model_copy(update={"max_steps": 20})
    cfg = CurationConfig(max_steps_margin=0.5, max_steps_floor=3)
    assert max_steps_for(task, None, cfg) == 20
    assert max_steps_for(task, stats_with(0, 8), cfg) == 20  # no success yet: the task's budget
    assert max_steps_for(task, stats_with(2, 8, (4, 6)), cfg) == 9  # ceil(6 * 1.5)
    assert max_steps_for(task, stats_with(1, 8, (1,)), cfg) == 3  # floor
    assert max_steps_for(task, stats_with(1, 8, (19,)), cfg) == 20  # ceiling = task budget
    assert max_steps_for(task, stats_with(1, 8, (19,)), cfg.model_copy(update={"max_steps_ceiling": 12})) == 12
    assert max_steps_for(task, stats_with(2, 8, (4, 6)), cfg.model_copy(update={"dynamic_max_steps": False})) == 20


def stored_factory(traj_factory, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A trajectory factory whose trajectories went through ingestion (inline images stored, referenced)."""
    blobs = TrajectoryBlobs(LocalStore(tmp_path / "store"))
    return lambda *args, **kwargs: blobs.put(traj_factory(*args, **kwargs)).trajectory


def test_experience_pool_fills_all_failure_group_of_hard_task(traj_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    traj_factory = stored_factory(traj_factory, tmp_path)
    cfg = CurationConfig(hard_task_threshold=0.3, pool_size_per_task=2)
    pool = ExperiencePool(cfg)
    hard = stats_with(1, 10)
    assert is_hard(hard, cfg) and not is_hard(stats_with(5, 10), cfg)
    win = traj_factory("old-win", gid="old", reward=1.0)
    assert pool.should_pool(win, hard) and not pool.should_pool(traj_factory("x", reward=0.0), hard)
    pool.add(win)
    pool.add(win)  # idempotent
    assert pool.size(TASK.task_id) == 1
    failures = [traj_factory(f"f{i}", gid="new", idx=i, size=3, reward=0.0) for i in range(3)]
    assert pool.fill(failures, stats_with(5, 10)) is None  # not hard
    asm = GroupAssembler(GroupingConfig(), fill=lambda gid, members: pool.fill(members, hard))
    ready: list[ReadyGroup] = []
    for t in failures:
        ready += asm.add(t, 3)
    assert len(ready) == 1 and ready[0].pooled == frozenset({"old-win"})
    assert [t.trajectory_id for t in ready[0].trajectories] == ["f0", "f1", "f2", "old-win"]
    samples = group_samples(ready[0], BatchingConfig())
    pooled = [s for s in samples if s.from_experience_pool]
    assert pooled and all(s.group_id == "new" and s.advantage > 0 for s in pooled)
    assert all(s.advantage < 0 for s in samples if not s.from_experience_pool)
    # Off: the all-failure group is dropped for zero variance.
    off = ExperiencePool(cfg.model_copy(update={"experience_pool": False}))
    off.add(win)
    dropped: list[tuple[str, str, str]] = []
    asm = GroupAssembler(
        GroupingConfig(), fill=lambda gid, members: off.fill(members, hard), on_drop=lambda *a: dropped.append(a)
    )
    for t in failures:
        assert asm.add(t, 3) == []
    assert dropped == [("new", TASK.task_id, "zero_variance")]


def test_group_advantages_and_step_samples_take_the_recorded_prompt_images(traj_factory) -> None:  # type: ignore[no-untyped-def]
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages([1.0, 0.0], scale_by_std=False) == [0.5, -0.5]
    with pytest.raises(ValueError):
        group_advantages([])
    ref = lambda w: m.ImageRef(uri=f"file:///s/{w}.png", sha256=SHA, width=w, height=2)  # noqa: E731
    win = traj_factory("a", idx=0, reward=1.0, steps=3)
    win = win.model_copy(
        update={
            "steps": [
                # As a runner showing two screenshots records them: the previous step's first.
                s.model_copy(update={"prompt_images": [ref(j + 1) for j in range(max(0, i - 1), i + 1)]})
                for i, s in enumerate(win.steps)
            ]
        }
    )
    lose = traj_factory("b", idx=1, reward=0.0, steps=1)
    lose = lose.model_copy(
        update={
            "steps": [
                lose.steps[0].model_copy(
                    update={"response_token_ids": [], "response_logprobs": [], "response_entropy": []}
                )
            ]
        }
    )
    group = ReadyGroup("g", [win, lose], complete=True)
    samples = group_samples(group, BatchingConfig())
    assert [(s.trajectory_id, s.step_index) for s in samples] == [
        ("a", 0),
        ("a", 1),
        ("a", 2),
    ]  # empty response skipped
    assert [len(s.images) for s in samples] == [1, 2, 2]
    assert [i.width for i in samples[2].images] == [2, 3]  # previous step's screenshot first
    assert all(s.advantage == pytest.approx(1.0, abs=1e-5) for s in samples)
    assert samples[1].rollout_logprobs == win.steps[1].response_logprobs
    assert samples[0].entropy == pytest.approx(0.5)


def test_batch_assembler_fills_by_samples_or_groups(traj_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    traj_factory = stored_factory(traj_factory, tmp_path)

    def group(gid: str) -> ReadyGroup:
        return ReadyGroup(
            gid, [traj_factory(f"{gid}-0", gid=gid, reward=1.0), traj_factory(f"{gid}-1", gid=gid, idx=1)], True
        )

    batcher = BatchAssembler(BatchingConfig(min_samples=8, max_groups=5), CurationConfig(), max_staleness=3)
    assert batcher.add(group("g1")) == (True, None)  # 4 samples
    accepted, formed = batcher.add(group("g2"))
    assert accepted and formed is not None
    assert formed.batch.group_ids == ["g1", "g2"] and len(formed.batch.samples) == 8
    assert [g.group_id for g in formed.groups] == ["g1", "g2"]
    assert formed.batch.max_staleness == 3  # the bound the trainer enforces again at training time
    again = BatchAssembler(BatchingConfig(min_samples=8, max_groups=5), CurationConfig(), max_staleness=None)
    again.add(group("g1"))
    assert again.add(group("g2"))[1].batch.batch_id == formed.batch.batch_id  # type: ignore[union-attr]  # deterministic
    by_groups = BatchAssembler(BatchingConfig(min_samples=100, max_groups=1), CurationConfig(), max_staleness=None)
    _, formed = by_groups.add(group("g3"))
    assert formed is not None and len(formed.batch.samples) == 4  # every step: selection is the trainer's


def test_outstanding_work_and_planner(traj_factory) -> None:  # type: ignore[no-untyped-def]
    now = [0.0]
    work = OutstandingWork(lambda: now[0])
    work.emitted("g1", 3)
    assert work.count == 3 and work.received("g1") and not work.received("other")
    work.emitted("g2", 2)
    now[0] = 100.0
    assert work.expire(50.0) == 4 and work.count == 0
    tasks = [TASK, TASK.model_copy(update={"task_id": "t2", "max_steps": 7})]
    stats = {"t2": stats_with(4, 8)}
    planner = WorkPlanner(
        tasks, CurationConfig(default_rollouts=3, min_rollouts=2, max_rollouts=6), EmissionConfig(), stats
    )
    g1 = planner.next_group(current_version=10, max_staleness=4)
    g2 = planner.next_group(current_version=1, max_staleness=4)
    by_task = {g[0].task.task_id: g for g in (g1, g2)}
    assert set(by_task) == {TASK.task_id, "t2"}  # one pass plans each task once, in a shuffled order
    default, t2 = by_task[TASK.task_id], by_task["t2"]
    assert [w.rollout_index for w in default] == [0, 1, 2] and len(t2) == 6
    assert all(w.min_policy_version == 6 for w in g1) and all(w.min_policy_version == 0 for w in g2)
    assert all(len({w.work_id for w in g}) == len(g) and len({w.group_id for w in g}) == 1 for g in (g1, g2))
    assert t2[0].max_steps == 5  # ceil(3 successful steps * 1.5), under the task budget 7
    assert planner.next_group(0, None)[0].task in tasks and planner.groups_planned == 3  # the next pass
    with pytest.raises(ValueError, match="empty"):
        WorkPlanner([], CurationConfig(), EmissionConfig(), {})


def test_load_task_suite_applies_defaults(tmp_path: Path) -> None:
    path = tmp_path / "suite.yaml"
    path.write_text(
        "name: s\nbackend: sim\nmax_steps: 5\ntasks:\n- {task_id: a, tags: [x]}\n- {task_id: b, max_steps: 2}\n"
    )
    a, b = load_task_suite(path)
    assert (a.backend, a.max_steps, a.tags, b.max_steps) == ("sim", 5, ("x",), 2)
    path.write_text("name: s\ntasks:\n- {task_id: a}\n")
    with pytest.raises(SuiteError, match="tasks\\.0"):
        load_task_suite(path)
