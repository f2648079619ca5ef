"""The rollout service end to end on a real nats-server and env service: work in, trajectories out."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nats
import pytest

from dart.env.service import EnvService, EnvServiceConfig
from dart.env.sim import LatencyConfig, SimConfig, sim_task
from dart.policy.config import PromptConfig
from dart.protocol.messages import Sampling, Trajectory, TrajectoryStatus, WorkItem
from dart.rollout.engine.hf import HFEngineConfig
from dart.rollout.service import RolloutConfig, RolloutService, RunnerConfig
from dart.rollout.service.scripted import ScriptedEngine
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.testing import wait_until
from dart.runtime.topology import durable_name, ensure_topology

pytestmark = pytest.mark.integration

FAST_SIM = SimConfig(latency=LatencyConfig(scale=0.0))


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    # A run name per test: its own streams, so counts below are this test's alone.
    config = BusConfig(url=nats_url, run=f"v{uuid.uuid4().hex[:8]}", connect_timeout_s=2.0, request_timeout_s=5.0)
    async with await Bus.connect(config) as connected:
        await ensure_topology(connected)
        yield connected


async def start_env(bus: Bus, **overrides: Any) -> EnvService:
    fields: dict[str, Any] = {"pool": f"p{uuid.uuid4().hex[:8]}", "instances": 4, "sim": FAST_SIM}
    fields.update(overrides)
    service = EnvService(EnvServiceConfig(**fields), bus)
    await service.start()
    return service


async def publish_work(bus: Bus, n: int, max_steps: int = 2) -> list[WorkItem]:
    items = [
        WorkItem(
            work_id=f"w{i}-{uuid.uuid4().hex[:6]}",
            task=sim_task("click-button", "easy", i),
            group_id=f"g{i // 2}",
            rollout_index=i % 2,
            group_size=2,
            max_steps=max_steps,
            sampling=Sampling(temperature=1.0),
            created_at=time.time(),
        )
        for i in range(n)
    ]
    for item in items:
        await bus.js_publish(bus.subjects.stream_subject("work"), item, msg_id=item.work_id)
    return items


async def stats_reach(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait until the service's counters satisfy ``condition``: a trajectory is on the stream before the
    service that published it has counted it."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110  (stats have no event)
            await asyncio.sleep(0.02)


async def collect_trajectories(bus: Bus, n: int, timeout_s: float) -> list[Trajectory]:
    consumer = await bus.pull_consumer("traj", durable_name(bus, "traj"), Trajectory)
    found: list[Trajectory] = []
    try:
        async with asyncio.timeout(timeout_s):
            while len(found) < n:
                for delivery in await consumer.fetch(n - len(found), timeout=1.0):
                    found.append(delivery.message)
                    await delivery.ack()
    finally:
        await consumer.close()
    return found


async def work_left(bus: Bus) -> int:
    return (await bus.stream_state("work")).messages


async def test_two_hf_engines_four_runners_turn_eight_items_into_eight_trajectories(bus: Bus, checkpoint: Path) -> None:
    env = await start_env(bus)
    config = RolloutConfig(
        engine=HFEngineConfig(model_path=str(checkpoint), num_threads=1, batch_wait_s=0.01),
        num_engines=2,
        runners=4,
        runner=RunnerConfig(pool=env.config.pool, max_new_tokens=24, prompt=PromptConfig(max_images=2)),
        fetch_timeout_s=0.2,
    )
    try:
        async with RolloutService(config, bus) as service:
            items = await publish_work(bus, 8)
            trajectories = await collect_trajectories(bus, 8, timeout_s=60)
            await stats_reach(lambda: sum(service.stats.trajectories.values()) == 8)
            stats = service.stats
    finally:
        await env.stop()
    assert sorted(t.work_id for t in trajectories) == sorted(i.work_id for i in items)
    assert all(t.status in (TrajectoryStatus.OK, TrajectoryStatus.TRUNCATED) for t in trajectories)
    assert all(1 <= len(t.steps) <= 2 and t.max_policy_version == 0 for t in trajectories)
    assert len({t.runner_id for t in trajectories}) >= 2  # work spread over runners, no batch barrier
    assert sum(stats.trajectories.values()) == 8 and stats.steps == sum(len(t.steps) for t in trajectories)
    assert set(stats.engine_busy_s) == {"engine-0", "engine-1"} and all(s > 0 for s in stats.engine_busy_s.values())
    assert await work_left(bus) == 0  # every work item acked


async def test_env_failure_publishes_env_failed_and_acks(bus: Bus) -> None:
    env = await start_env(bus, backend="rollout-crash-on-wait", instances=1)
    engine = ScriptedEngine(["Action: wait()"])
    config = RolloutConfig(runners=2, runner=RunnerConfig(pool=env.config.pool), fetch_timeout_s=0.2)
    try:
        async with RolloutService(config, bus, engines={"scripted": engine}) as service:
            await publish_work(bus, 1, max_steps=3)
            (trajectory,) = await collect_trajectories(bus, 1, timeout_s=20)
            await stats_reach(lambda: service.stats.trajectories == {"env_failed": 1})
    finally:
        await env.stop()
    assert trajectory.status is TrajectoryStatus.ENV_FAILED and not trajectory.trainable
    assert await work_left(bus) == 0


async def test_stop_aborts_running_trajectories_and_still_publishes_them(bus: Bus) -> None:
    env = await start_env(bus, instances=2)
    engine = ScriptedEngine(["Action: wait()"], generate_s=60.0)
    config = RolloutConfig(runners=2, runner=RunnerConfig(pool=env.config.pool), fetch_timeout_s=0.2)
    service = RolloutService(config, bus, engines={"slow": engine})
    try:
        await service.start()
        await publish_work(bus, 2)
        async with asyncio.timeout(10):
            while engine.load < 2:  # noqa: ASYNC110  (the engine has no event for "request arrived")
                await asyncio.sleep(0.02)
        started = time.monotonic()
        await service.stop(timeout_s=0.2)
        assert time.monotonic() - started < 5.0
    finally:
        await env.stop()
    trajectories = await collect_trajectories(bus, 2, timeout_s=10)
    assert [t.status for t in trajectories] == [TrajectoryStatus.ABORTED] * 2
    assert await work_left(bus) == 0


async def test_failed_publish_naks_the_work_item_for_redelivery(bus: Bus, nats_url: str) -> None:
    env = await start_env(bus, instances=1)
    engine = ScriptedEngine(["Action: finished(content='done')"])
    config = RolloutConfig(
        runners=1, runner=RunnerConfig(pool=env.config.pool), fetch_timeout_s=0.2, publish_retry_s=0.5
    )
    try:
        async with RolloutService(config, bus, engines={"scripted": engine}) as service:
            # No trajectory stream (removed after start, as an operator might): every publish fails.
            admin = await nats.connect(nats_url)
            try:
                await admin.jetstream().delete_stream(bus.subjects.stream_name("traj"))
            finally:
                await admin.close()
            await publish_work(bus, 1)
            async with asyncio.timeout(20):
                # nak'ed, hence redelivered at once and run again (not after ack_wait).
                while service.stats.publish_failures < 2:  # noqa: ASYNC110  (stats have no event)
                    await asyncio.sleep(0.05)
            assert not service.stats.trajectories
    finally:
        await env.stop()
    assert await work_left(bus) == 1  # never acked


async def test_a_trajectory_too_large_for_the_bus_is_published_as_failed_and_settled(bus: Bus) -> None:
    """Running the episode again would make the same oversized message: it is answered once, as failed."""
    env = await start_env(bus, instances=1)
    engine = ScriptedEngine(["Action: wait()"])
    config = RolloutConfig(runners=1, runner=RunnerConfig(pool=env.config.pool), fetch_timeout_s=0.2)
    limited = bus.config.model_copy(update={"max_message_bytes": 4096})  # below 3 steps' inline screenshots
    try:
        async with await Bus.connect(limited) as small, RolloutService(config, small, engines={"s": engine}) as service:
            await publish_work(bus, 1, max_steps=3)
            (trajectory,) = await collect_trajectories(bus, 1, timeout_s=20)
            await stats_reach(lambda: service.stats.trajectories == {"failed": 1})
            assert service.stats.publish_failures == 1
    finally:
        await env.stop()
    assert trajectory.status is TrajectoryStatus.FAILED and trajectory.steps == []
    assert trajectory.error is not None and "3 steps dropped" in trajectory.error and "bus limit" in trajectory.error
    assert await work_left(bus) == 0  # acked: not run again


async def test_a_publish_refused_for_a_moment_is_tried_again_and_stored(
    bus: Bus, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream that does not answer for a while (a cluster electing its leader) costs no rerun."""
    env = await start_env(bus, instances=1)
    engine = ScriptedEngine(["Action: finished(content='done')"])
    config = RolloutConfig(
        runners=1, runner=RunnerConfig(pool=env.config.pool), fetch_timeout_s=0.2, publish_retry_s=120.0
    )
    name = bus.subjects.stream_name("traj")
    try:
        async with RolloutService(config, bus, engines={"scripted": engine}) as service:
            admin = await nats.connect(nats_url)
            try:
                js = admin.jetstream()
                stream = (await js.stream_info(name)).config
                await js.delete_stream(name)
                await publish_work(bus, 1)
                await wait_until(lambda: any("publishing traj-" in r.getMessage() for r in caplog.records))
                await js.add_stream(config=stream)  # the stream answers again
                await wait_until(lambda: service.stats.trajectories.get("ok", 0) == 1)
                assert service.stats.publish_failures == 0
                assert (await js.stream_info(name)).state.messages == 1
            finally:
                await admin.close()
    finally:
        await env.stop()
    assert await work_left(bus) == 0  # acked once stored
