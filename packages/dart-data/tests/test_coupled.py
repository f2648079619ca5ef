"""Coupled mode (the synchronous batch-RL baseline) against a real nats-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dart.data.config import (
    BatchingConfig,
    CoupledConfig,
    CurationConfig,
    DataConfig,
    DecoupledConfig,
    EmissionConfig,
    GroupingConfig,
)
from dart.data.service import DataService
from dart.protocol import messages as m
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.runtime.bus import Bus, Delivery
from dart.runtime.store import LocalStore
from dart.runtime.telemetry import TelemetryConfig, read_jsonl, setup_telemetry
from dart.runtime.testing import SHA, TASK, wait_until
from dart.runtime.topology import durable_name, ensure_topology

pytestmark = pytest.mark.integration

TASKS = [TASK, TASK.model_copy(update={"task_id": "sim/click/2"}), TASK.model_copy(update={"task_id": "sim/click/3"})]


def coupled_config(tmp_path: Path, *, work_timeout_s: float = 60.0) -> DataConfig:
    return DataConfig(
        database_url=f"sqlite:///{tmp_path / 'data.sqlite3'}",
        grouping=GroupingConfig(timeout_s=60, max_staleness=2, poll_interval_s=0.05),
        # Two rollouts per group and batch limits far below a round: coupled mode must ignore them.
        curation=CurationConfig(default_rollouts=2, min_rollouts=2, max_rollouts=2, experience_pool=False),
        emission=EmissionConfig(
            mode="coupled",
            coupled=CoupledConfig(tasks_per_round=3),
            decoupled=DecoupledConfig(max_outstanding=2),
            work_timeout_s=work_timeout_s,
        ),
        batching=BatchingConfig(min_samples=2, max_groups=1),
    )


async def answer(bus: Bus, work: list[Delivery[m.WorkItem]], rewards: dict[str, list[float]], traj_factory) -> None:  # type: ignore[no-untyped-def]
    """Publish one trajectory per work item, rewards by group (in task order), and ack the items."""
    for d in work:
        w = d.message
        reward = rewards[w.task.task_id][w.rollout_index]
        traj = traj_factory(
            f"t-{w.work_id}", gid=w.group_id, idx=w.rollout_index, reward=reward, task=w.task, work_id=w.work_id
        )
        await bus.js_publish(bus.subjects.stream_subject("traj"), traj, msg_id=traj.trajectory_id)
        await d.ack()


async def queued(bus: Bus) -> int:
    return (await bus.stream_state("work")).messages


async def test_coupled_round_barrier_batch_and_version_sync(bus: Bus, tmp_path: Path, traj_factory) -> None:  # type: ignore[no-untyped-def]
    telemetry = setup_telemetry("dart-data", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path))
    service = DataService(coupled_config(tmp_path), bus, LocalStore(tmp_path / "store"), TASKS, telemetry)
    runner = await bus.pull_consumer("work", durable_name(bus, "work"), m.WorkItem)
    trainer = await bus.pull_consumer("batch", durable_name(bus, "batch"), m.TrainingBatch)
    state = await ensure_topology(bus)
    try:
        async with service:
            # Round 1: exactly B x n = 3 x 2 items, at the current version (staleness 0).
            await wait_until(lambda: service.stats.work_items == 6)
            first = await runner.fetch(6, timeout=5)
            assert len(first) == 6 and all(d.message.min_policy_version == 3 for d in first)
            # A round of B = len(TASKS) groups is one pass: every task once, in the pass's shuffled order.
            assert sorted(d.message.task.task_id for d in first[::2]) == sorted(t.task_id for t in TASKS)
            # Half the round arrives: no batch (although batching limits are exceeded), no new work.
            rewards = {TASKS[0].task_id: [1.0, 0.0], TASKS[1].task_id: [0.0, 0.0], TASKS[2].task_id: [0.0, 1.0]}
            await answer(bus, first[:4], rewards, traj_factory)
            await wait_until(lambda: service.stats.stored == 4)
            await asyncio.sleep(0.5)
            assert service.stats.work_items == 6 and service.stats.batches == 0 and await queued(bus) == 2
            # The rest arrives: ONE batch with the round's two groups that have reward variance.
            await answer(bus, first[4:], rewards, traj_factory)
            [delivery] = await trainer.fetch(1, timeout=10)
            await delivery.ack()
            batch = delivery.message
            groups = {d.message.task.task_id: d.message.group_id for d in first}
            assert sorted(batch.group_ids) == sorted([groups[TASKS[0].task_id], groups[TASKS[2].task_id]])
            assert len(batch.samples) == 8 and (batch.min_policy_version, batch.max_policy_version) == (3, 3)
            # Trained, but no new version yet: round 2 waits for it.
            await asyncio.sleep(0.5)
            assert service.stats.work_items == 6 and service.stats.groups_dropped == {"zero_variance": 1}
            await state.put(LATEST_MODEL_KEY, m.ModelVersion(version=4, uri="file:///w/v4", sha256=SHA, created_at=2.0))
            await wait_until(lambda: service.stats.work_items == 12)
            second = await runner.fetch(6, timeout=5)
            assert len(second) == 6 and all(d.message.min_policy_version == 4 for d in second)
            await asyncio.sleep(0.3)
            assert service.stats.work_items == 12 and service.stats.rounds == 1
            for d in second:
                await d.ack()
    finally:
        telemetry.shutdown()
        await runner.close()
        await trainer.close()
    events = [r["attributes"] for r in read_jsonl(telemetry.jsonl_path, types={"event"}) if r["name"] == "data.round"]
    assert events[0]["round"] == 1 and events[0]["groups"] == 2 and events[0]["samples"] == 8
    assert events[0]["lost"] == 0 and events[0]["version"] == 3 and not events[0]["sync_timed_out"]


async def test_coupled_round_times_out_and_skips_training_when_nothing_remains(  # type: ignore[no-untyped-def]
    bus: Bus, tmp_path: Path, traj_factory
) -> None:
    service = DataService(coupled_config(tmp_path, work_timeout_s=1.0), bus, LocalStore(tmp_path / "store"), TASKS)
    runner = await bus.pull_consumer("work", durable_name(bus, "work"), m.WorkItem)
    async with service:
        await wait_until(lambda: service.stats.work_items == 6)
        first = await runner.fetch(6, timeout=5)
        # One trajectory per group never arrives; the rest all failed: nothing to train on.
        await answer(bus, first[::2], {t.task_id: [0.0, 0.0] for t in TASKS}, traj_factory)
        # The round times out, the missing ones count as lost, training is skipped and the next
        # round goes out at the same version without waiting for a new one.
        await wait_until(lambda: service.stats.work_items == 12, timeout_s=10)
        stats = service.stats
        assert (stats.rounds, stats.round_lost, stats.batches) == (1, 3, 0)
        second = await runner.fetch(6, timeout=5)
        assert all(d.message.min_policy_version == 3 for d in second)
        for d in [*first[1::2], *second]:
            await d.ack()
    await runner.close()
