"""The MiniWoB++ backend in a real headless Chromium: oracles, actions, rewards, lifecycle."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from PIL import Image

from dart.env.errors import EpisodeStateError, TaskParamsError
from dart.env.miniwob import SOLVERS, MiniWoBEnv, miniwob_task, task_names
from dart.env.miniwob.browser import find_binary
from dart.protocol.messages import Click, DoubleClick, Drag, Fail, Finished, Hotkey, RightClick, Scroll, TaskSpec, Type
from dart.protocol.messages import Wait as WaitAction
from dart.protocol.messages.actions import ScrollDirection

pytestmark = pytest.mark.integration

CHROME = find_binary("MINIWOB_CHROME_BINARY", "chromium", "chromium-browser")
DRIVER = find_binary("MINIWOB_CHROMEDRIVER", "chromedriver")
needs_chromium = pytest.mark.skipif(
    CHROME is None or DRIVER is None,
    reason="Chromium and chromedriver are not installed (apt-get install chromium chromium-driver; .ci/run does)",
)


@pytest.fixture(scope="module")
def env() -> Iterator[MiniWoBEnv]:
    """One browser for the module's tests (starting one takes seconds)."""
    if CHROME is None or DRIVER is None:
        pytest.skip("Chromium and chromedriver are not installed")
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never download anything
    backend = MiniWoBEnv()
    asyncio.run(backend.start())
    yield backend
    asyncio.run(backend.close())


async def solve(env: MiniWoBEnv, task: TaskSpec, seed: int, max_steps: int = 12) -> tuple[float, bool, int]:
    """Reset, follow the oracle until the episode ends, evaluate: (reward, success, steps)."""
    await env.reset(task, seed=seed)
    steps, done = 0, False
    while not done and (step := env.oracle_action()) is not None and steps < max_steps:
        _, done, _ = await env.step(step[1])
        steps += 1
    assert done, f"{task.task_id} seed {seed}: the oracle stopped after {steps} steps without ending the episode"
    assert env.oracle_action() is None
    reward, success, _ = await env.evaluate()
    return reward, success, steps


@needs_chromium
@pytest.mark.parametrize("name", ["click-test", "click-button", "enter-text"])
async def test_oracle_solves_core_tasks(env: MiniWoBEnv, name: str) -> None:
    task = miniwob_task(name)
    observation, instruction = await env.reset(task, seed=3)
    assert instruction and observation.text == instruction
    assert observation.screenshot is not None and observation.screenshot.kind == "inline"
    image = Image.open(io.BytesIO(observation.screenshot.png))
    assert image.size == env.screen_size == (160, 210)
    assert set(observation.metadata) == {"task_id", "task", "step"}  # no DOM reaches the policy
    for seed in (3, 4):
        reward, success, _ = await solve(env, task, seed)
        assert (reward, success) == (1.0, True)


@needs_chromium
@pytest.mark.parametrize("name", sorted(SOLVERS))
async def test_every_oracle_task_succeeds(env: MiniWoBEnv, name: str) -> None:
    assert len(SOLVERS) >= 10 and name in task_names()
    for seed in (11, 12):
        reward, success, _ = await solve(env, miniwob_task(name), seed)
        assert (reward, success) == (1.0, True), f"{name} seed {seed}"


@needs_chromium
async def test_the_same_seed_gives_the_same_episode(env: MiniWoBEnv) -> None:
    first, instruction = await env.reset(miniwob_task("click-button"), seed=5)
    again, same = await env.reset(miniwob_task("click-button", seed=5), seed=99)  # params.seed wins
    assert instruction == same and first.screenshot == again.screenshot


@needs_chromium
async def test_a_wrong_click_fails_the_task(env: MiniWoBEnv) -> None:
    _, instruction = await env.reset(miniwob_task("click-test-2"), seed=1)
    target = instruction.removeprefix("Click button ").rstrip(".")
    wrong = "TWO" if target == "ONE" else "ONE"
    button = env._dom.find("button", text=wrong)[0]
    x, y = button.center
    _, done, info = await env.step(Click(x=x / 160, y=y / 210))
    assert done and info["raw_reward"] == -1.0
    reward, success, details = await env.evaluate()
    assert (reward, success, details["raw_reward"]) == (0.0, False, -1.0)


@needs_chromium
async def test_declaring_finished_without_solving_is_no_success(env: MiniWoBEnv) -> None:
    await env.reset(miniwob_task("click-test"), seed=1)
    _, done, _ = await env.step(Click(x=0.5, y=0.1))  # the instruction bar: nothing happens
    assert not done
    _, done, _ = await env.step(Finished())
    assert done
    reward, success, details = await env.evaluate()
    assert (reward, success, details["miniwob_done"]) == (0.0, False, False)
    with pytest.raises(EpisodeStateError):
        await env.step(Click(x=0.5, y=0.5))
    await env.reset(miniwob_task("click-test"), seed=1)
    assert (await env.step(Fail(reason="cannot")))[1]


@needs_chromium
async def test_every_action_kind_runs(env: MiniWoBEnv) -> None:
    await env.reset(miniwob_task("enter-text"), seed=2)
    field = next(e for e in env._dom.elements if e.id == "tt")
    fx, fy = field.center[0] / 160, field.center[1] / 210
    await env.step(Click(x=fx, y=fy))
    await env.step(Type(text="abc"))
    await env.step(Hotkey(keys=("ctrl", "a")))
    await env.step(Type(text="xyz"))
    await env.step(Hotkey(keys=("backspace",)))  # "abc", select all, "xyz" replaces it, backspace
    assert next(e for e in env._dom.elements if e.id == "tt").value == "xy"
    _, _, info = await env.step(Hotkey(keys=("ctrl", "no-such-key")))  # a policy's mistake, not a crash
    assert str(info["event"]).startswith("ignored: unknown key")
    await env.step(Type(text="Q\U0001f600"))  # chromedriver cannot type the emoji; it is dropped
    for action in (
        DoubleClick(x=fx, y=fy),
        RightClick(x=fx, y=fy),
        Drag(x1=0.1, y1=0.5, x2=0.6, y2=0.7),
        Scroll(x=0.5, y=0.5, direction=ScrollDirection.DOWN, amount=2),
        WaitAction(seconds=0.0),
    ):
        observation, done, info = await env.step(action)
        assert not done and observation.screenshot is not None
    assert next(e for e in env._dom.elements if e.id == "tt").value == "xyQ"
    _, done, _ = await env.step(Type(text="\n"))  # Enter submits the form with the wrong text
    reward, success, _ = await env.evaluate()
    assert not success and reward == 0.0


@needs_chromium
async def test_task_ids_and_params(env: MiniWoBEnv) -> None:
    assert len(task_names()) > 100
    for task in (
        TaskSpec(task_id="t", backend="miniwob", params={"env_id": "miniwob/click-test-v1"}),
        TaskSpec(task_id="miniwob/click-test", backend="miniwob"),
        TaskSpec(task_id="miniwob/click-test/4", backend="miniwob"),
        TaskSpec(task_id="x", backend="miniwob", params={"env_id": "click-test"}),
    ):
        assert MiniWoBEnv.parse_params(task)[0] == "click-test"
    assert MiniWoBEnv.parse_params(miniwob_task("click-tab", seed=7)) == ("click-tab", 7)
    bad = [
        TaskSpec(task_id="t", backend="sim", params={"env_id": "click-test"}),
        TaskSpec(task_id="t", backend="miniwob", params={"env_id": "no-such-task"}),
        TaskSpec(task_id="t", backend="miniwob", params={"env_id": "click-test", "seed": "7"}),
        TaskSpec(task_id="t", backend="miniwob", params={"env_id": "click-test", "level": 2}),
    ]
    for task in bad:
        with pytest.raises(TaskParamsError):
            await env.reset(task)


@needs_chromium
async def test_lifecycle_of_an_instance() -> None:
    env = MiniWoBEnv()
    with pytest.raises(EpisodeStateError):
        await env.step(Click(x=0.5, y=0.5))
    async with env:
        assert env.state == "ready"
        with pytest.raises(EpisodeStateError):
            await env.evaluate()
        await env.reset(miniwob_task("click-test"))
        assert env.state == "in_episode"
    assert env.state == "closed"
    await env.close()
    with pytest.raises(EpisodeStateError):
        await env.reset(miniwob_task("click-test"))


@needs_chromium
async def test_train_and_heldout_splits_share_task_types_on_disjoint_seeds(env: MiniWoBEnv) -> None:
    from dart.env.miniwob.catalog import load_builtin_suite

    train, held = load_builtin_suite("train").tasks, load_builtin_suite("heldout").tasks
    smoke = load_builtin_suite("smoke").tasks
    kinds = {t.params["env_id"] for t in smoke}
    assert {t.params["env_id"] for t in train} == kinds == {t.params["env_id"] for t in held}
    train_seeds, held_seeds = {t.params["seed"] for t in train}, {t.params["seed"] for t in held}
    assert len(train_seeds) == 3 and len(held_seeds) == 2
    assert not train_seeds & held_seeds and not held_seeds & {t.params["seed"] for t in smoke}
    # The shipped instructions are what the page shows for each held-out seed.
    for task in held:
        _, instruction = await env.reset(task)
        assert instruction == task.instruction, task.task_id


def _browser_processes(group: int) -> list[str]:
    """Live (not zombie) processes of process group ``group``: ``pid command`` lines from ps."""
    out = subprocess.run(["ps", "-eo", "pgid=,stat=,pid=,comm="], capture_output=True, text=True, check=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    return [f"{r[2]} {r[3]}" for r in rows if len(r) == 4 and int(r[0]) == group and not r[1].startswith("Z")]


@needs_chromium
def test_a_killed_process_leaves_no_browser_behind() -> None:
    """An env service SIGKILLed (a crash, a supervisor's kill) takes its browsers along."""
    code = (
        "import json, time\n"
        "from dart.env.miniwob.browser import Browser\n"
        f"browser = Browser({CHROME!r}, {DRIVER!r}, 1, 60.0)\n"
        "print(json.dumps(browser.driver_pid), flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line, f"the browser did not start (exit {parent.wait()})"
    group = json.loads(line)
    assert any("chrom" in p for p in _browser_processes(group))
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    parent.stdout.close()
    deadline = time.monotonic() + 60
    while _browser_processes(group):
        assert time.monotonic() < deadline, f"outlived the killed process: {_browser_processes(group)}"
        time.sleep(0.1)
