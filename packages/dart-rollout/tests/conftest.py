"""Shared fixtures of dart-rollout's tests: one tiny checkpoint per session, a bus per test, env services on
test-unique pools, a crashing env."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dart.env.service import EnvService, EnvServiceConfig, register_backend, unregister_backend
from dart.env.sim import LatencyConfig, SimConfig, SimEnv, sim_task
from dart.protocol.bus import Bus, BusConfig
from dart.protocol.messages import Action, Observation, Wait, WorkItem
from dart.protocol.messages.observation import MetadataValue
from dart.rollout.model.tiny import write_tiny_checkpoint

FAST_SIM = SimConfig(latency=LatencyConfig(scale=0.0))
"""The sim without simulated latency."""

CRASH_BACKEND = "rollout-crash-on-wait"
"""Env backend name of :class:`CrashOnWait`, registered for every test."""


class CrashOnWait(SimEnv):
    """A sim env whose step crashes on ``wait``, like a dying browser."""

    async def step(self, action: Action) -> tuple[Observation, bool, dict[str, MetadataValue]]:
        if isinstance(action, Wait):
            raise RuntimeError("simulated browser crash")
        return await super().step(action)


@pytest.fixture(autouse=True)
def _crash_backend() -> Iterator[None]:
    register_backend(CRASH_BACKEND, lambda cfg, stream: CrashOnWait(cfg.sim, stream=stream), replace=True)
    yield
    unregister_backend(CRASH_BACKEND)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-VL checkpoint, written once per session (tests must not modify it)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(path, seed=0)
    return path


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    """A bus with its own run id, so each test has its own streams."""
    config = BusConfig(url=nats_url, run=f"r{uuid.uuid4().hex[:8]}", connect_timeout_s=2.0, request_timeout_s=5.0)
    async with await Bus.connect(config) as connected:
        yield connected


@pytest.fixture
async def env_pool(bus: Bus) -> AsyncIterator[Callable[..., Any]]:
    """Starts env services on pools unique to the test; returns the pool name."""
    services: list[EnvService] = []

    async def start(**overrides: Any) -> str:
        fields: dict[str, Any] = {"pool": f"p{uuid.uuid4().hex[:8]}", "instances": 1, "sim": FAST_SIM}
        fields.update(overrides)
        service = EnvService(EnvServiceConfig(**fields), bus)
        await service.start()
        services.append(service)
        return str(fields["pool"])

    yield start
    for service in services:
        await service.stop()


def _work_item(max_steps: int = 3, *, min_policy_version: int = 0) -> WorkItem:
    return WorkItem(
        work_id=f"w-{uuid.uuid4().hex[:8]}",
        task=sim_task("click-button", "easy", 1),
        group_id="g-1",
        rollout_index=0,
        group_size=1,
        max_steps=max_steps,
        min_policy_version=min_policy_version,
        temperature=1.0,
        created_at=time.time(),
    )


@pytest.fixture
def work_item() -> Callable[..., WorkItem]:
    """Makes work items for the sim's easy click-button task (``max_steps``, ``min_policy_version``), new ids each."""
    return _work_item
