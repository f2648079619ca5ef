"""Retention of trajectory blobs and shared screenshots, against a real nats-server, a local artifact
store and both index databases: nothing the trainer may still read is deleted, the rest is."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dart.data.config import (
    BatchingConfig,
    CurationConfig,
    DataConfig,
    EmissionConfig,
    GroupingConfig,
    RetentionConfig,
)
from dart.data.service import DataService
from dart.protocol import messages as m
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.runtime.bus import Bus, BusConfig, KeyValueStore
from dart.runtime.store import ArtifactStore, LocalStore
from dart.runtime.testing import SHA, TASK, tiny_png, wait_until
from dart.runtime.topology import durable_name, ensure_topology

pytestmark = pytest.mark.integration

GRACE_S = 1.0


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    async with await Bus.connect(BusConfig(url=nats_url, run=f"ret{uuid.uuid4().hex[:8]}")) as bus:
        yield bus


async def announce(state: KeyValueStore, version: int) -> None:
    model = m.ModelVersion(version=version, uri=f"file:///w/v{version}.safetensors", sha256=SHA, created_at=1.0)
    await state.put(LATEST_MODEL_KEY, model)


def shared_screenshot(store: ArtifactStore, width: int) -> m.ImageRef:
    """A screenshot stored the way the env service stores one (``screenshots/<sha256>.png``)."""
    png = tiny_png(width, 3)
    digest = hashlib.sha256(png).hexdigest()
    info = store.put(f"screenshots/{digest}.png", png, content_type="image/png", sha256=digest)
    return m.ImageRef(uri=info.uri, sha256=digest, width=width, height=3)


def with_shared_first_step(traj: m.Trajectory, ref: m.ImageRef) -> m.Trajectory:
    first = traj.steps[0]
    first = first.model_copy(
        update={"observation": first.observation.model_copy(update={"screenshot": ref}), "prompt_images": [ref]}
    )
    return traj.model_copy(update={"steps": [first, *traj.steps[1:]]})


async def older_than_grace(store: ArtifactStore, key: str) -> None:
    """Wait until the object's last write is older than the grace period (a condition, not a guess)."""
    written = store.stat(key).modified
    assert written is not None
    await wait_until(lambda: time.time() - written.timestamp() > GRACE_S + 0.05)


async def test_retention_deletes_only_what_the_trainer_is_done_with(  # type: ignore[no-untyped-def]
    bus: Bus, tmp_path: Path, database_url: str, traj_factory
) -> None:
    state = await ensure_topology(bus)
    await announce(state, 3)
    store = LocalStore(tmp_path / "store")
    retention = RetentionConfig(keep_versions=1, keep_every=2, interval_s=3600, image_grace_s=GRACE_S)
    config = DataConfig(
        database_url=database_url,
        grouping=GroupingConfig(timeout_s=30, poll_interval_s=0.05),
        curation=CurationConfig(default_rollouts=2, min_rollouts=2, max_rollouts=2, experience_pool=False),
        emission=EmissionConfig(enabled=False),
        batching=BatchingConfig(min_samples=4, max_groups=1),
        retention=retention,
    )
    service = DataService(config, bus, store, [])
    trainer = await bus.pull_consumer("batch", durable_name(bus, "batch"), m.TrainingBatch)
    async with service:
        index, blobs = service.state.index, service.state.blobs
        # Written after the index started recording references (the sweep leaves older screenshots alone).
        shared = shared_screenshot(store, 7)  # referenced by a (trained) and c (dropped)
        unreferenced = shared_screenshot(store, 9)  # an evaluation episode's, say: no trajectory refers to it
        shared_key, unreferenced_key = (r.uri.removeprefix(store.uri("k")[:-1]) for r in (shared, unreferenced))
        trajs = [
            with_shared_first_step(traj_factory("a", gid="g1", idx=0, reward=1.0), shared),
            traj_factory("b", gid="g1", idx=1, reward=0.0),
            with_shared_first_step(traj_factory("c", gid="g2", idx=0, reward=0.0), shared),
            traj_factory("d", gid="g2", idx=1, reward=0.0),  # g2: equal rewards, dropped
            traj_factory("e", gid="g3", idx=0, reward=0.0, version=4),
            traj_factory("f", gid="g3", idx=1, reward=0.0, version=4),  # g3: dropped, but version 4 % 2 == 0
        ]
        for t in trajs:
            await bus.js_publish(bus.subjects.stream_subject("traj"), t, msg_id=t.trajectory_id)
        await wait_until(lambda: service.stats.stored == 6 and service.stats.batches == 1)
        await wait_until(lambda: all((index.group(g) or {}).get("status") == "dropped" for g in ("g2", "g3")))
        assert index.referenced([shared_key, unreferenced_key]) == {shared_key}
        assert index.trajectory("a")["last_batch_seq"] is not None  # type: ignore[index]
        index.add_to_pool("b", "sim/click/1", keep=4)  # b is in the experience pool from now on

        def stored(tid: str) -> bool:
            return any(True for _ in store.list(blobs.directory(tid) + "/"))

        assert all(stored(t.trajectory_id) for t in trajs)

        # Version 3 is the newest and kept (keep_versions 1): no trajectory goes; the old unreferenced
        # screenshot does, the referenced one stays.
        await older_than_grace(store, unreferenced_key)
        first = await service.retention.run_pass()
        assert (first.trajectories, first.screenshots) == (0, 1)
        assert not store.exists(unreferenced_key) and store.exists(shared_key)

        # Version 5: the dropped group's trajectories go; the batched ones wait for the trainer, and
        # version 4's are kept (keep_every 2).
        await announce(state, 5)
        await wait_until(lambda: service.policy_version == 5)
        second = await service.retention.run_pass()
        assert second.trajectories == 2 and not stored("c") and not stored("d")
        assert all(stored(t) for t in "abef")
        assert store.exists(shared_key)  # a still refers to it
        assert index.trajectory("c")["pruned_at"] is not None and index.trajectory("a")["pruned_at"] is None  # type: ignore[index]

        # The trainer acks the batch: a goes, b stays (pooled); with a and c gone nothing refers to
        # the shared screenshot, which goes once it is older than the grace period.
        [delivery] = await trainer.fetch(1, timeout=10)
        assert {s.trajectory_id for s in delivery.message.samples} == {"a", "b"}
        await delivery.ack()
        await wait_for_ack_floor(bus)
        await older_than_grace(store, shared_key)
        third = await service.retention.run_pass()
        assert (third.trajectories, third.screenshots) == (1, 1)
        assert not stored("a") and stored("b") and stored("e") and stored("f")
        assert not store.exists(shared_key)
        assert index.referenced([shared_key]) == set()
        stats = service.stats
        assert (stats.pruned_trajectories, stats.pruned_screenshots) == (3, 2)
        assert stats.pruned_objects == sum(p.objects for p in (first, second, third)) > 3
        # Rows stay: statistics and reports still see every trajectory.
        assert index.count_trajectories() == 6 and index.pruned_count() == 3

        # Nothing left to do: a further pass deletes nothing.
        assert (await service.retention.run_pass()).objects == 0


async def wait_for_ack_floor(bus: Bus) -> None:
    deadline = asyncio.get_running_loop().time() + 20
    while (await bus.consumer_state("batch", durable_name(bus, "batch"))).ack_floor < 1:
        assert asyncio.get_running_loop().time() < deadline, "the trainer's ack never reached the server"
        await asyncio.sleep(0.05)


async def test_a_screenshot_written_before_references_were_recorded_is_kept(bus: Bus, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    old = shared_screenshot(store, 5)  # written before the index (schema version 4) existed
    key = old.uri.removeprefix(store.uri("k")[:-1])
    await ensure_topology(bus)
    retention = RetentionConfig(interval_s=3600, image_grace_s=GRACE_S)
    config = DataConfig(
        database_url=f"sqlite:///{tmp_path / 'data.sqlite3'}",
        emission=EmissionConfig(enabled=False),
        retention=retention,
    )
    async with DataService(config, bus, store, []) as service:
        await older_than_grace(store, key)
        done = await service.retention.run_pass()
    assert done.screenshots == 0 and store.exists(key)


async def test_a_screenshot_of_an_episode_longer_than_the_grace_stays_until_its_trajectory_arrives(  # type: ignore[no-untyped-def]
    bus: Bus, tmp_path: Path, traj_factory
) -> None:
    """An episode that runs past the grace period: the screenshot its first step stored is not deleted while
    the episode's work is awaited (before, any unreferenced screenshot older than the grace went), and goes
    once the group's trajectories are in and none of them refers to it."""
    store = LocalStore(tmp_path / "store")
    await ensure_topology(bus)
    config = DataConfig(
        database_url=f"sqlite:///{tmp_path / 'data.sqlite3'}",
        grouping=GroupingConfig(timeout_s=60, poll_interval_s=0.05),
        curation=CurationConfig(default_rollouts=2, min_rollouts=2, max_rollouts=2, experience_pool=False),
        emission=EmissionConfig(max_groups=1, work_timeout_s=3600),
        retention=RetentionConfig(interval_s=3600, image_grace_s=GRACE_S),
    )
    async with DataService(config, bus, store, [TASK]) as service:
        runner = await bus.pull_consumer("work", durable_name(bus, "work"), m.WorkItem)
        work: list[m.WorkItem] = []
        while len(work) < 2:
            for delivery in await runner.fetch(2 - len(work), timeout=5):
                work.append(delivery.message)
                await delivery.ack()
        first_step = shared_screenshot(store, 11)  # what the env stored at the episode's first step
        key = first_step.uri.removeprefix(store.uri("k")[:-1])
        await older_than_grace(store, key)
        assert (await service.retention.run_pass()).screenshots == 0 and store.exists(key)

        # The episodes end (their trajectories carry other screenshots, as if the agent's screen changed).
        for w in work:
            traj = traj_factory(f"t-{w.work_id}", gid=w.group_id, idx=w.rollout_index, work_id=w.work_id)
            await bus.js_publish(bus.subjects.stream_subject("traj"), traj, msg_id=traj.trajectory_id)
        await wait_until(lambda: service.stats.stored == 2)
        await wait_until(lambda: service.emitter is not None and service.emitter.outstanding.count == 0)
        await wait_for_ingest_acks(bus)  # a pass leaves screenshots alone while trajectories wait on the stream
        assert (await service.retention.run_pass()).screenshots == 1 and not store.exists(key)


async def wait_for_ingest_acks(bus: Bus) -> None:
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        ingest = await bus.consumer_state("traj", durable_name(bus, "traj"))
        if not (ingest.num_pending or ingest.num_ack_pending):
            return
        assert asyncio.get_running_loop().time() < deadline, "the ingestor's acks never reached the server"
        await asyncio.sleep(0.05)
