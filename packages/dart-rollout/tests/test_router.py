"""The engine router: least-loaded serving engine, skipping updating ones, waiting when none serve."""

from __future__ import annotations

import asyncio

import pytest

from dart.policy.prompt import ChatPrompt
from dart.rollout.engine.interface import EngineState, GenerationRequest
from dart.rollout.errors import NoEngineError
from dart.rollout.service.router import EngineRouter
from dart.rollout.service.scripted import ScriptedEngine

pytestmark = pytest.mark.unit

REQUEST = GenerationRequest(ChatPrompt("hi"), max_new_tokens=4)


async def test_picks_least_loaded_and_spreads_ties() -> None:
    busy, idle = ScriptedEngine(["a"], generate_s=10.0), ScriptedEngine(["b"])
    router = EngineRouter({"busy": busy, "idle": idle})
    pending = asyncio.create_task(busy.generate(REQUEST))
    await asyncio.sleep(0)
    assert busy.load == 1
    assert [router.engine_id(await router.pick()) for _ in range(3)] == ["idle"] * 3
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)
    # Equal load: round robin, so both engines get work.
    assert {router.engine_id(await router.pick()) for _ in range(4)} == {"busy", "idle"}


async def test_skips_draining_engine_and_waits_when_none_serve() -> None:
    a, b = ScriptedEngine(["a"], generate_s=0.2), ScriptedEngine(["b"], update_s=0.3)
    router = EngineRouter({"a": a, "b": b}, poll_interval_s=0.005)
    # a serves a request, so b is less loaded; but b is updating, so a is the only choice.
    inflight = asyncio.create_task(a.generate(REQUEST))
    update_b = asyncio.create_task(b.update_weights("w", 1))
    await asyncio.sleep(0.01)
    assert b.state is not EngineState.SERVING
    assert router.engine_id(await router.pick()) == "a"
    # Now both are updating: pick waits until one serves again.
    update_a = asyncio.create_task(a.update_weights("w", 1))
    await asyncio.sleep(0.01)
    picked = asyncio.create_task(router.pick())
    await asyncio.sleep(0.05)
    assert not picked.done()
    engine = await asyncio.wait_for(picked, timeout=2.0)
    assert engine.state is EngineState.SERVING and engine.version == 1
    await asyncio.gather(inflight, update_a, update_b)


async def test_min_version_preferred_then_any_and_timeout() -> None:
    old, new = ScriptedEngine(["a"], version=0), ScriptedEngine(["b"], version=3)
    router = EngineRouter({"old": old, "new": new})
    assert [router.engine_id(await router.pick(min_version=3)) for _ in range(3)] == ["new"] * 3
    # Nobody at version 5: after the brief wait, any serving engine is used.
    assert (await router.pick(min_version=5, min_version_wait_s=0.05)).version in (0, 3)
    # Updating engines are not closed: pick waits for them, up to its timeout.
    slow = ScriptedEngine(["c"], update_s=1.0)
    solo = EngineRouter([slow])
    updating = asyncio.create_task(slow.update_weights("w", 1))
    await asyncio.sleep(0.01)
    with pytest.raises(NoEngineError):
        await solo.pick(timeout_s=0.05)
    updating.cancel()
    await asyncio.gather(updating, return_exceptions=True)
    # Closed engines never come back: no point waiting.
    await old.close()
    await new.close()
    with pytest.raises(NoEngineError):
        await router.pick()


async def test_busy_time_is_accounted_per_engine() -> None:
    engine = ScriptedEngine(["a"], generate_s=0.05)
    router = EngineRouter([engine])
    with router.busy(engine):
        await engine.generate(REQUEST)
    assert router.busy_seconds()["engine-0"] >= 0.04
