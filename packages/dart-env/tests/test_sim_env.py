"""SimEnv: the async backend interface, its lifecycle, determinism and simulated latency."""

from __future__ import annotations

import io
import time

import pytest
from PIL import Image

from dart.env.errors import EpisodeStateError, TaskParamsError
from dart.env.interface import BackendState, EnvBackend
from dart.env.sim import ConstantLatency, LatencyConfig, SimConfig, SimEnv, sim_task
from dart.env.sim.families import FAMILIES
from dart.protocol.messages import (
    Action,
    Click,
    Fail,
    Finished,
    Hotkey,
    InlineImage,
    Observation,
    Scroll,
    ScrollDirection,
    TaskSpec,
    Type,
    Wait,
)

pytestmark = pytest.mark.unit


def _png(obs: Observation) -> bytes:
    assert isinstance(obs.screenshot, InlineImage)
    return obs.screenshot.png


async def _solve(env: SimEnv, task: TaskSpec, seed: int | None = None) -> tuple[list[bytes], float]:
    obs, _ = await env.reset(task, seed)
    shots = [_png(obs)]
    done = False
    while (step := env.oracle_action()) is not None:
        assert not done
        obs, done, _ = await env.step(step[1])
        shots.append(_png(obs))
    assert done
    reward, success, _ = await env.evaluate()
    assert success is (reward == 1.0)
    return shots, reward


async def test_reset_returns_the_instruction_and_a_screenshot() -> None:
    env = SimEnv()
    assert isinstance(env, EnvBackend) and env.state == BackendState.CREATED
    task = sim_task("tick-boxes", "medium", 5)
    obs, instruction = await env.reset(task)
    assert env.state == BackendState.IN_EPISODE
    assert instruction == task.instruction == obs.text
    assert obs.metadata == {"task_id": task.task_id, "family": "tick-boxes", "step": 0}
    assert isinstance(obs.screenshot, InlineImage)
    assert (obs.screenshot.width, obs.screenshot.height) == env.screen_size == (224, 224)
    image = Image.open(io.BytesIO(obs.screenshot.png))
    assert image.size == (224, 224) and image.mode == "RGB"


async def test_oracle_solves_each_family_through_the_env() -> None:
    env = SimEnv()
    for family in FAMILIES:
        for difficulty in ("easy", "hard"):
            shots, reward = await _solve(env, sim_task(family, difficulty, 8))
            assert reward == 1.0
            assert len(set(shots)) == len(shots)  # every action changed the screen
    assert env.oracle_action() is None  # the episode is over


async def test_same_task_seed_and_actions_give_identical_observations_and_rewards() -> None:
    for family in FAMILIES:
        task = sim_task(family, "hard", 21)
        a, b = SimEnv(), SimEnv(stream=7)
        assert await _solve(a, task) == await _solve(b, task)
        # Replaying a fixed, partly wrong action sequence is deterministic too.
        actions: list[Action] = [
            Click(x=0.5, y=0.5),
            Type(text="zz"),
            Scroll(x=0.3, y=0.6, direction=ScrollDirection.DOWN),
            Hotkey(keys=("tab",)),
            Finished(),
        ]
        runs = []
        for env in (a, b):
            obs, _ = await env.reset(task)
            trace = [_png(obs)]
            for action in actions:
                obs, done, info = await env.step(action)
                trace.append(_png(obs))
                if done:
                    break
            runs.append((trace, await env.evaluate()))
        assert runs[0] == runs[1]


async def test_reset_seed_picks_the_layout_only_when_the_task_has_none() -> None:
    env = SimEnv()
    free = TaskSpec(task_id="t", backend="sim", params={"family": "click-button", "difficulty": "hard"})
    shots = {_png((await env.reset(free, seed))[0]) for seed in (1, 2, 3)}
    assert len(shots) == 3
    assert _png((await env.reset(free, 2))[0]) in shots
    fixed = sim_task("click-button", "hard", 4)
    assert len({_png((await env.reset(fixed, seed))[0]) for seed in (1, 2, 3)}) == 1


async def test_terminal_actions_end_the_episode_with_reward_zero() -> None:
    env = SimEnv()
    for terminal in (Finished(content="done"), Fail(reason="cannot")):
        await env.reset(sim_task("select-item", "easy", 2))
        obs, done, info = await env.step(Wait())
        assert not done and info == {"event": "wait", "step": 1}
        obs, done, info = await env.step(terminal)
        assert done and env.state == BackendState.DONE
        assert obs.metadata["step"] == 2
        reward, success, details = await env.evaluate()
        assert (reward, success) == (0.0, False)
        assert details["reason"] == "no button was pressed" and details["steps"] == 2


async def test_lifecycle_errors() -> None:
    env = SimEnv()
    with pytest.raises(EpisodeStateError, match="call reset first"):
        await env.step(Wait())
    with pytest.raises(EpisodeStateError):
        await env.evaluate()
    await env.reset(sim_task("click-button", "easy", 0))
    step = env.oracle_action()
    assert step is not None
    _, done, info = await env.step(step[1])
    assert done and str(info["event"]).startswith("press:")
    with pytest.raises(EpisodeStateError, match="the episode has ended") as caught:
        await env.step(Wait())
    assert (caught.value.operation, caught.value.state) == ("step", "done")
    assert (await env.evaluate())[0] == (await env.evaluate())[0] == 1.0  # repeatable
    await env.reset(sim_task("click-button", "easy", 1))  # a new episode after done
    assert env.state == BackendState.IN_EPISODE
    await env.close()
    await env.close()  # idempotent
    with pytest.raises(EpisodeStateError, match="closed"):
        await env.reset(sim_task("click-button", "easy", 1))
    assert env.oracle_action() is None


async def test_async_context_manager_starts_and_closes() -> None:
    async with SimEnv() as env:
        assert env.state == BackendState.READY
    assert env.state == BackendState.CLOSED


async def test_invalid_tasks_are_rejected_with_the_reason() -> None:
    env = SimEnv()
    with pytest.raises(TaskParamsError, match="it is a 'miniwob' task"):
        await env.reset(TaskSpec(task_id="m", backend="miniwob", params={"family": "click-button"}))
    with pytest.raises(TaskParamsError, match=r"params\.family") as caught:
        await env.reset(TaskSpec(task_id="x", backend="sim", params={"family": "draw-circle"}))
    assert caught.value.task_id == "x" and caught.value.backend == "sim"
    with pytest.raises(TaskParamsError, match=r"params\.target"):
        await env.reset(TaskSpec(task_id="y", backend="sim", params={"family": "click-button", "target": "OK"}))


async def test_configured_screen_size() -> None:
    env = SimEnv(SimConfig(width=320, height=256))
    obs, _ = await env.reset(sim_task("enter-text", "hard", 3))
    assert isinstance(obs.screenshot, InlineImage)
    assert (obs.screenshot.width, obs.screenshot.height) == env.screen_size == (320, 256)
    assert Image.open(io.BytesIO(obs.screenshot.png)).size == (320, 256)
    assert (await _solve(env, sim_task("enter-text", "hard", 3)))[1] == 1.0


async def test_latency_is_waited_and_recorded() -> None:
    config = SimConfig(
        latency=LatencyConfig(
            step=ConstantLatency(seconds=0.03),
            reset=ConstantLatency(seconds=0.05),
            evaluate=ConstantLatency(seconds=0.01),
        )
    )
    env = SimEnv(config)
    start = time.monotonic()
    await env.reset(sim_task("click-button", "easy", 0))
    assert time.monotonic() - start >= 0.05
    start = time.monotonic()
    await env.step(Wait())
    assert time.monotonic() - start >= 0.03
    await env.evaluate()
    assert [(s.op, s.seconds) for s in env.latencies] == [("reset", 0.05), ("step", 0.03), ("evaluate", 0.01)]
    assert env.last_latency_s == 0.01

    zero = SimEnv(SimConfig(latency=config.latency.model_copy(update={"scale": 0.0})))
    start = time.monotonic()
    await _solve(zero, sim_task("tick-boxes", "hard", 0))
    assert time.monotonic() - start < 0.5
    assert zero.latencies and all(s.seconds == 0.0 for s in zero.latencies)
