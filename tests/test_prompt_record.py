"""The trajectory is the single record of what the policy consumed.

A real env service (sim backend) sends its screenshots by reference over a real nats-server, a runner
drives the real hf engine on them, dart-data stores the trajectory and forms the training samples
from it, and dart-train rebuilds the model inputs from those samples alone: its recomputed log-probs
equal the engine's recorded ones. Nothing here passes a rollout setting (image size, screenshots per
prompt) to data or train.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from dart.data.batches import group_samples
from dart.data.blobs import TrajectoryBlobs
from dart.data.config import BatchingConfig
from dart.data.groups import ReadyGroup
from dart.env.service import EnvService, EnvServiceConfig
from dart.env.sim import LatencyConfig, SimConfig, sim_task
from dart.policy.config import PromptConfig
from dart.policy.tiny import write_tiny_checkpoint
from dart.protocol.messages import ImageRef, InlineImage, Sampling, TrajectoryStatus, WorkItem
from dart.protocol.messages.codec import encode
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.service.config import RunnerConfig
from dart.rollout.service.images import ImageCache
from dart.rollout.service.router import EngineRouter
from dart.rollout.service.runner import TrajectoryRunner
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.store import LocalStore
from dart.train.backend import TorchBackend
from dart.train.batching import StoreImageSource
from dart.train.config import TrainerConfig

pytestmark = pytest.mark.integration

LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(path, seed=0)
    return path


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    config = BusConfig(url=nats_url, run=f"r{uuid.uuid4().hex[:8]}", connect_timeout_s=2.0, request_timeout_s=10.0)
    async with await Bus.connect(config) as connected:
        yield connected


@pytest.mark.parametrize(
    ("screen", "image_size"),
    [((1920, 1080), 224), ((640, 360), None)],
    ids=["1080p-resized-to-224", "640x360-as-is"],
)
async def test_trainer_rebuilds_the_engines_inputs_from_the_stored_trajectory(
    bus: Bus, checkpoint: Path, tmp_path: Path, screen: tuple[int, int], image_size: int | None
) -> None:
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    pool = f"p{uuid.uuid4().hex[:8]}"
    sim = SimConfig(width=screen[0], height=screen[1], latency=LatencyConfig(scale=0.0))
    env_config = EnvServiceConfig(pool=pool, instances=1, sim=sim, inline_max_bytes=1024)
    engine = await HFEngine.start(HFEngineConfig(model_path=str(checkpoint), num_threads=2, batch_wait_s=0.0))
    images = ImageCache(max_bytes=64 * 1024 * 1024)
    try:
        async with EnvService(env_config, bus, store=store) as env:
            runner = TrajectoryRunner(
                "runner-t",
                bus,
                EngineRouter([engine]),
                RunnerConfig(pool=pool, prompt=PromptConfig(max_images=2, image_size=image_size), max_new_tokens=8),
                images=images,
            )
            work = WorkItem(
                work_id=f"w-{uuid.uuid4().hex[:8]}",
                task=sim_task("click-button", "easy", 1),
                group_id="g",
                rollout_index=0,
                group_size=1,
                max_steps=3,
                sampling=Sampling(temperature=1.0),
                created_at=time.time(),
            )
            trajectory = await runner.run(work)
            assert env.screenshots.referenced >= 1
            # Read through the cache: each distinct screenshot fetched once.
            assert images.artifacts.misses == len({s.observation.screenshot for s in trajectory.steps})
    finally:
        await engine.close()
        images.close()
    assert trajectory.status in (TrajectoryStatus.OK, TrajectoryStatus.TRUNCATED), trajectory.error
    assert all(isinstance(s.observation.screenshot, ImageRef) for s in trajectory.steps)
    for i, step in enumerate(trajectory.steps):
        assert len(step.prompt_images) == min(i + 1, 2)  # the current screenshot and at most one earlier
        for fed in step.prompt_images:
            assert (fed.width, fed.height) == ((image_size, image_size) if image_size else screen)
        if image_size is None:
            # Fed as sent: the record is the env's own reference, nothing re-uploaded.
            assert step.prompt_images[-1] == step.observation.screenshot
        else:
            assert all(isinstance(fed, InlineImage) for fed in step.prompt_images)
    print(f"trajectory message: {len(encode(trajectory))} bytes for {len(trajectory.steps)} steps at {screen}")

    # dart-data's ingestion and batching, then dart-train's recomputation (blocking work: in threads).
    stored = await asyncio.to_thread(TrajectoryBlobs(store).put, trajectory)
    samples = group_samples(ReadyGroup("g", [stored.trajectory], complete=True), BatchingConfig())
    assert [s.step_index for s in samples] == [s.index for s in trajectory.steps]
    config = TrainerConfig(model_path=str(checkpoint), num_threads=2)
    backend = await asyncio.to_thread(TorchBackend.load, config, image_source=StoreImageSource())
    worst = 0.0
    for sample, logp in zip(samples, await asyncio.to_thread(backend.compute_logprobs, samples), strict=True):
        worst = max(worst, float((logp - torch.tensor(sample.rollout_logprobs)).abs().max()))
    print(f"max |trainer - engine| log-prob difference at {screen}, image_size {image_size}: {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE
