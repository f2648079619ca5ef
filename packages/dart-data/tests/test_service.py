"""The data service against a real nats-server and a local artifact store."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from dart.data.config import (
    BatchingConfig,
    CurationConfig,
    DataConfig,
    DecoupledConfig,
    EmissionConfig,
    GroupingConfig,
)
from dart.data.service import DataService
from dart.protocol import messages as m
from dart.protocol.errors import ConfigError
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.runtime.bus import Bus
from dart.runtime.store import LocalStore, get_by_uri
from dart.runtime.telemetry import TelemetryConfig, read_jsonl, setup_telemetry
from dart.runtime.testing import SHA, TASK, wait_until
from dart.runtime.topology import durable_name, ensure_topology

pytestmark = pytest.mark.integration


def config(tmp_path: Path, **updates: object) -> DataConfig:
    base = DataConfig(
        database_url=f"sqlite:///{tmp_path / 'data.sqlite3'}",
        grouping=GroupingConfig(timeout_s=30, poll_interval_s=0.05),
        curation=CurationConfig(default_rollouts=2, min_rollouts=2, max_rollouts=2),
        emission=EmissionConfig(enabled=False),
        batching=BatchingConfig(min_samples=8, max_groups=8),
    )
    return base.model_copy(update=updates)


async def test_trajectories_become_a_batch_once(bus: Bus, tmp_path: Path, database_url: str, traj_factory) -> None:  # type: ignore[no-untyped-def]
    store = LocalStore(tmp_path / "store")
    trajs = [
        traj_factory("a", gid="g1", idx=0, reward=1.0),
        traj_factory("b", gid="g1", idx=1, reward=0.0),
        traj_factory("c", gid="g2", idx=0, reward=0.0),
        traj_factory("d", gid="g2", idx=1, reward=1.0),
    ]
    subject = bus.subjects.stream_subject("traj")
    for t in trajs[:3]:
        await bus.js_publish(subject, t, msg_id=t.trajectory_id)
    # A republish that JetStream's dedupe window cannot catch (another msg id): must be stored once.
    await bus.js_publish(subject, trajs[0], msg_id="a-again")
    await bus.js_publish(subject, trajs[3], msg_id="d")

    telemetry = setup_telemetry("dart-data", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path))
    service = DataService(config(tmp_path, database_url=database_url), bus, store, [TASK], telemetry)
    trainer = await bus.pull_consumer("batch", durable_name(bus, "batch"), m.TrainingBatch)
    try:
        async with service:
            [delivery] = await trainer.fetch(1, timeout=10)
            batch = delivery.message
            await delivery.ack()
            # The batch is delivered before the service records it as published: wait on both conditions.
            await wait_until(lambda: service.stats.received == 5 and service.stats.batches == 1)
            stats = service.stats
    finally:
        telemetry.shutdown()
    events = {r["name"]: r["attributes"] for r in read_jsonl(telemetry.jsonl_path, types={"event"})}
    assert events["data.batch"]["samples"] == 8 and events["data.batch"]["staleness"] == 0
    assert events["data.stats"]["stored"] == 4 and events["data.stats"]["duplicates"] == 1
    assert (stats.stored, stats.duplicates, stats.batches, stats.groups_emitted) == (4, 1, 1, 2)
    assert service.policy_version == 3
    assert stats.task_success[TASK.task_id] == pytest.approx(0.5)
    assert stats.success_rate == pytest.approx(0.5) and events["data.stats"]["success_rate"] == pytest.approx(0.5)

    assert sorted(batch.group_ids) == ["g1", "g2"] and len(batch.samples) == 8
    assert (batch.min_policy_version, batch.max_policy_version) == (3, 3)
    for s in batch.samples:
        expected = 1.0 if s.trajectory_id in {"a", "d"} else -1.0
        assert s.advantage == pytest.approx(expected, abs=1e-5)
        assert s.reward == (1.0 if expected > 0 else 0.0)
        assert len(s.images) == 1 and s.prompt_token_ids[-1] == s.step_index
        png = get_by_uri(s.images[0].uri)
        assert png.startswith(m.observation.PNG_SIGNATURE) and hashlib.sha256(png).hexdigest() == s.images[0].sha256
        assert s.images[0].width == s.step_index + 2  # the step's own screenshot
    assert {(s.trajectory_id, s.step_index) for s in batch.samples} == {(t, i) for t in "abcd" for i in range(2)}

    # Restart on the same database: everything is still there, nothing is redone, and a late
    # redelivery of a batched group's member does not form that group again.
    await bus.js_publish(subject, trajs[1], msg_id="b-late")
    again = DataService(config(tmp_path, database_url=database_url), bus, store, [TASK])
    await again.start()
    await wait_until(lambda: again.stats.duplicates == 1)
    assert again.former.groups.open_groups == 0
    assert again.state.index.count_trajectories() == 4
    assert again.state.task_stats[TASK.task_id].attempts == 4
    group = again.state.index.group("g1")
    assert group is not None and (group["status"], group["batch_id"]) == ("emitted", batch.batch_id)
    await again.stop()
    await again.stop()  # idempotent
    await trainer.close()


async def test_work_emission_respects_max_outstanding(bus: Bus, tmp_path: Path, traj_factory) -> None:  # type: ignore[no-untyped-def]
    tasks = [TASK, TASK.model_copy(update={"task_id": "sim/click/2"})]
    cfg = config(
        tmp_path,
        emission=EmissionConfig(decoupled=DecoupledConfig(max_outstanding=4, poll_interval_s=0.05)),
        grouping=GroupingConfig(timeout_s=30, max_staleness=2, poll_interval_s=0.05),
    )
    service = DataService(cfg, bus, LocalStore(tmp_path / "store"), tasks)
    runner = await bus.pull_consumer("work", durable_name(bus, "work"), m.WorkItem)

    async def queued() -> int:
        return (await bus.stream_state("work")).messages

    async with service:
        await wait_until(lambda: service.stats.work_items == 4)
        await asyncio.sleep(0.3)  # backpressure: nothing more while 4 are outstanding
        assert service.stats.work_items == 4 and service.stats.outstanding == 4 and await queued() == 4
        items = await runner.fetch(2, timeout=5)
        assert [(w.message.task.task_id, w.message.rollout_index) for w in items] == [
            (TASK.task_id, 0),
            (TASK.task_id, 1),
        ]
        assert all(w.message.min_policy_version == 1 and w.message.group_size == 2 for w in items)  # version 3 - 2
        # A new policy while the emitter waits: the held group's version floor follows it.
        state = await ensure_topology(bus)
        await state.put(LATEST_MODEL_KEY, m.ModelVersion(version=7, uri="file:///w/v7", sha256=SHA, created_at=2.0))
        await wait_until(lambda: service.policy_version == 7)
        for i, delivery in enumerate(items):
            work = delivery.message
            traj = traj_factory(
                f"t{i}", gid=work.group_id, idx=work.rollout_index, reward=float(i), work_id=work.work_id
            )
            await bus.js_publish(bus.subjects.stream_subject("traj"), traj, msg_id=traj.trajectory_id)
            await delivery.ack()
        # Two trajectories arrived: room for exactly one more group of two.
        await wait_until(lambda: service.stats.work_items == 6)
        await asyncio.sleep(0.3)
        stats = service.stats
        assert (stats.work_items, stats.work_groups, stats.outstanding) == (6, 3, 4)
        nxt = await runner.fetch(4, timeout=5)
        assert [w.message.task.task_id for w in nxt] == ["sim/click/2", "sim/click/2", TASK.task_id, TASK.task_id]
        assert [w.message.min_policy_version for w in nxt] == [1, 1, 5, 5]  # 7 - 2 for the new group
        for w in nxt:
            await w.ack()
    await runner.close()


async def test_emission_pauses_while_batches_wait_for_the_trainer(bus: Bus, tmp_path: Path) -> None:
    """AReaL-style throttle: work generated for a trainer that lags would be trained stale or dropped."""
    cfg = config(
        tmp_path,
        emission=EmissionConfig(
            decoupled=DecoupledConfig(max_outstanding=4, poll_interval_s=0.05, max_queued_batches=1)
        ),
    )
    sample = m.TrainingSample(
        trajectory_id="t",
        step_index=0,
        group_id="g",
        task_id=TASK.task_id,
        advantage=1.0,
        reward=1.0,
        policy_version=3,
        prompt_token_ids=[1],
        response_token_ids=[2],
        rollout_logprobs=[-0.1],
    )
    for i in range(2):  # two batches wait untrained: over the limit of one
        batch = m.TrainingBatch(
            batch_id=f"b{i}",
            samples=[sample],
            group_ids=["g"],
            min_policy_version=3,
            max_policy_version=3,
            created_at=1,
        )
        await bus.js_publish(bus.subjects.stream_subject("batch"), batch, msg_id=batch.batch_id)
    service = DataService(cfg, bus, LocalStore(tmp_path / "store"), [TASK])
    trainer = await bus.pull_consumer("batch", durable_name(bus, "batch"), m.TrainingBatch)
    async with service:
        await wait_until(lambda: service.stats.emission_throttles == 1)
        assert service.stats.work_items == 0 and (await bus.stream_state("work")).messages == 0
        # The trainer takes one: the backlog is at the limit, no longer over it, and emission resumes.
        [delivery] = await trainer.fetch(1, timeout=10)
        await delivery.ack()
        await wait_until(lambda: service.stats.work_items == 4)  # then max_outstanding holds it
        assert service.stats.emission_throttles == 1
    await trainer.close()


async def test_experience_pool_fills_a_hard_tasks_failed_group(bus: Bus, tmp_path: Path, traj_factory) -> None:  # type: ignore[no-untyped-def]
    store = LocalStore(tmp_path / "store")
    cfg = config(tmp_path, curation=CurationConfig(hard_task_threshold=0.6, pool_size_per_task=2))
    subject = bus.subjects.stream_subject("traj")
    for t in [
        traj_factory("lose", gid="g0", idx=0, reward=0.0),
        traj_factory("win", gid="g0", idx=1, reward=1.0),  # task at 1/2 < 0.6 after it: pooled
        traj_factory("f0", gid="g1", idx=0, reward=0.0),
        traj_factory("f1", gid="g1", idx=1, reward=0.0),
    ]:
        await bus.js_publish(subject, t, msg_id=t.trajectory_id)
    service = DataService(cfg, bus, store, [TASK])
    trainer = await bus.pull_consumer("batch", durable_name(bus, "batch"), m.TrainingBatch)
    async with service:
        [delivery] = await trainer.fetch(1, timeout=10)
        await delivery.ack()
        stats = service.stats
    batch = delivery.message
    assert batch.group_ids == ["g0", "g1"] and stats.pool_size == 1 and stats.pool_served == 1
    pooled = [s for s in batch.samples if s.from_experience_pool]
    assert {(s.trajectory_id, s.group_id) for s in pooled} == {("win", "g1")}
    assert all(s.advantage > 0 for s in pooled)
    assert all(s.advantage < 0 for s in batch.samples if s.group_id == "g1" and not s.from_experience_pool)
    restarted = DataService(cfg, bus, store, [TASK])
    await restarted.start()
    assert restarted.state.pool.size(TASK.task_id) == 1  # reloaded from the index and the blob
    await restarted.stop()
    await trainer.close()


async def test_start_refuses_unusable_emission_settings(bus: Bus, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    with pytest.raises(ConfigError, match="emission.enabled"):
        await DataService(config(tmp_path, emission=EmissionConfig()), bus, store, []).start()
