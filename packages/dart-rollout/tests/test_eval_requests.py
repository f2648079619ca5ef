"""Evaluations on the rollout service's own engines, asked for by ``EvalRequest`` on a real nats-server.

The request names a version by number; the service loads only what the trainer announced under that
number on the ``model`` stream, and the engine it lends to the evaluation takes no training request until
it is back at the newest version.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from safetensors.torch import save_file

from dart.env.sim import sim_task
from dart.protocol.errors import RemoteError
from dart.protocol.messages import EvalRequest, EvalResult, Message, ModelVersion, Sampling, TaskSpec, Trajectory
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.rollout.service import RolloutConfig, RolloutService, RunnerConfig
from dart.rollout.service.scripted import ScriptedEngine
from dart.runtime.bus import Bus
from dart.runtime.testing import wait_until
from dart.runtime.topology import durable_name, ensure_topology

pytestmark = pytest.mark.integration

EnvPool = Callable[..., Coroutine[Any, Any, str]]


def published(tmp_path: Path, version: int) -> ModelVersion:
    """Weights of ``version`` written as the trainer writes one shard, and their record."""
    path = tmp_path / f"v{version}.safetensors"
    save_file({"w": torch.full((2,), float(version))}, str(path))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return ModelVersion(version=version, uri=path.as_uri(), sha256=digest, created_at=time.time())


async def announce(bus: Bus, model: ModelVersion) -> None:
    """Announce ``model`` as the trainer does: on the model stream, then as the latest in the state bucket."""
    state = await ensure_topology(bus)
    await bus.js_publish(bus.subjects.stream_subject("model"), model, msg_id=f"model-v{model.version}")
    await state.put(LATEST_MODEL_KEY, model)


def eval_request(version: int, pool: str, tasks: list[TaskSpec], **overrides: Any) -> EvalRequest:
    fields: dict[str, Any] = {
        "label": f"heldout-v{version}",
        "version": version,
        "tasks": tasks,
        "pool": pool,
        "episodes_per_task": 2,
        "sampling": Sampling(temperature=0.0),
        "concurrency": 2,
    }
    fields.update(overrides)
    return EvalRequest(**fields)


class RequestWithItsOwnWeights(Message):
    """An evaluation request as an older caller (or a forger) would send it: with a weights record of its own."""

    kind: Literal["eval_request"] = "eval_request"
    label: str
    version: ModelVersion
    tasks: list[TaskSpec]
    pool: str
    episodes_per_task: int
    sampling: Sampling
    concurrency: int


async def test_an_evaluation_request_runs_on_one_engine_held_at_the_version_while_the_other_updates(
    bus: Bus, env_pool: EnvPool, tmp_path: Path
) -> None:
    """The run's held-out validation path: an ``EvalRequest`` on the rollout service's own engines."""
    train_pool, eval_pool = await env_pool(instances=1), await env_pool(instances=2)
    engines = {n: ScriptedEngine(["Action: finished(content='done')"], generate_s=0.3) for n in ("a", "b")}
    config = RolloutConfig(runners=1, runner=RunnerConfig(pool=train_pool), fetch_timeout_s=0.2)
    tasks = [sim_task("click-button", "easy", i) for i in range(3)]
    async with RolloutService(config, bus, engines=dict(engines)):
        await announce(bus, published(tmp_path, 1))
        await wait_until(lambda: all(e.version == 1 for e in engines.values()))
        request = eval_request(1, eval_pool, tasks)
        asked = asyncio.create_task(bus.request(bus.subjects.eval_request(), request, EvalResult, timeout=60))
        await wait_until(lambda: any(e.load > 0 for e in engines.values()))
        await announce(bus, published(tmp_path, 2))  # announced mid-evaluation
        await wait_until(lambda: sorted(e.version for e in engines.values()) == [1, 2])
        result = await asked
        held = engines[result.engine_id]
        # Every episode ran on the held engine at version 1; the other one took version 2 meanwhile.
        assert result.policy_version == 1 and result.engine == "ScriptedEngine"
        assert sum(t.n for t in result.tasks) == 6 and sum(t.errors for t in result.tasks) == 0
        assert {c.version for c in held.calls} == {1}
        # Released, the held engine catches up with the newest version.
        await wait_until(lambda: all(e.version == 2 for e in engines.values()))
        # Version 0 (the start checkpoint) is served by no engine any more: refused, not served by another.
        with pytest.raises(RemoteError, match="version 0"):
            await bus.request(
                bus.subjects.eval_request(), request.model_copy(update={"version": 0}), EvalResult, timeout=30
            )


async def test_a_version_never_announced_is_refused_and_no_engine_loads_anything(
    bus: Bus, env_pool: EnvPool, tmp_path: Path
) -> None:
    train_pool, eval_pool = await env_pool(instances=1), await env_pool(instances=1)
    engines = {n: ScriptedEngine(["Action: finished(content='done')"]) for n in ("a", "b")}
    config = RolloutConfig(runners=1, runner=RunnerConfig(pool=train_pool), fetch_timeout_s=0.2)
    tasks = [sim_task("click-button", "easy", 0)]
    # Version 2's weights are in place and its record's digests are right, but the trainer never announced it.
    unannounced = published(tmp_path, 2)
    async with RolloutService(config, bus, engines=dict(engines)) as service:
        await announce(bus, published(tmp_path, 1))
        await announce(bus, published(tmp_path, 3))
        await wait_until(lambda: all(e.version == 3 for e in engines.values()))
        updates = list(service.sync.updates)
        for version in (2, 4):  # between two announced versions, and past the newest
            with pytest.raises(RemoteError) as info:
                await bus.request(
                    bus.subjects.eval_request(), eval_request(version, eval_pool, tasks), EvalResult, timeout=30
                )
            assert info.value.code == "not_found" and info.value.details == {"version": version}
            assert f"version {version} was never announced" in info.value.message
        # A request that brings its own record of the weights is not one: the schema names a version by number.
        forged = RequestWithItsOwnWeights(
            label="heldout-v2",
            version=unannounced,
            tasks=tasks,
            pool=eval_pool,
            episodes_per_task=1,
            sampling=Sampling(temperature=0.0),
            concurrency=1,
        )
        with pytest.raises(RemoteError) as info:
            await bus.request(bus.subjects.eval_request(), forged, EvalResult, timeout=30)
        assert info.value.code == "invalid_request"
        # Nothing was loaded: every engine still serves version 3, and no update was made or tried.
        assert all(e.version == 3 for e in engines.values()) and service.sync.updates == updates
        assert not any(Path(unannounced.uri.removeprefix("file://")) in e.loaded for e in engines.values())


async def test_an_engine_lent_to_an_evaluation_takes_training_again_only_at_the_newest_version(
    bus: Bus, env_pool: EnvPool, tmp_path: Path, work_item: Callable[..., Any]
) -> None:
    train_pool, eval_pool = await env_pool(instances=4), await env_pool(instances=1)
    engines = {
        n: ScriptedEngine(["Action: wait()", "Action: finished(content='done')"], generate_s=0.02, update_s=0.2)
        for n in ("a", "b")
    }
    config = RolloutConfig(runners=4, runner=RunnerConfig(pool=train_pool), fetch_timeout_s=0.2)
    # Versions 1 and 2 are announced before the service starts: training is served at 0 or 2, never at 1.
    await announce(bus, published(tmp_path, 1))
    await announce(bus, published(tmp_path, 2))
    for _ in range(400):
        item = work_item(max_steps=2)
        await bus.js_publish(bus.subjects.stream_subject("work"), item, msg_id=item.work_id)
    tasks = [sim_task("click-button", "easy", 100 + i) for i in range(2)]
    async with RolloutService(config, bus, engines=dict(engines)) as service:
        await wait_until(lambda: all(e.version == 2 for e in engines.values()))
        await wait_until(lambda: sum(service.stats.trajectories.values()) >= 4)  # training is under way
        request = eval_request(1, eval_pool, tasks, concurrency=1)
        result = await bus.request(bus.subjects.eval_request(), request, EvalResult, timeout=60)
        assert result.policy_version == 1 and sum(t.n for t in result.tasks) == 4
        held = engines[result.engine_id]
        answered = len(held.calls)
        # Back at version 2, the engine serves training again, and only at version 2.
        await wait_until(lambda: any(c.version == 2 for c in held.calls[answered:]))
        assert {c.version for c in held.calls[answered:]} == {2}
    published_count = sum(service.stats.trajectories.values())
    consumer = await bus.pull_consumer("traj", durable_name(bus, "traj"), Trajectory)
    trajectories: list[Trajectory] = []
    try:
        async with asyncio.timeout(30):
            while len(trajectories) < published_count:
                trajectories += [d.message for d in await consumer.fetch(published_count, timeout=1.0)]
    finally:
        await consumer.close()
    # No training step was generated by the weights the evaluation loaded.
    versions = {step.policy_version for t in trajectories for step in t.steps}
    assert 2 in versions and 1 not in versions
