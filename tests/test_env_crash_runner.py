"""Real env processes killed mid-trajectory: the runner ends the trajectory ``env_failed``, the
lease is released, the instance is replaced (by a warm spare) and the next trajectory runs. A whole
env service killed mid-step ends the step at once, not at the request timeout. Also: a shipped
OSWorld-format local-desktop task solved over NATS.

Everything is real: nats-server, the env service hosting real backends (MiniWoB++ in Chromium, the
``osworld`` backend on a local X desktop), the rollout's trajectory runner; the engine is the
deterministic ``ScriptedEngine`` so the episode lasts long enough to be killed in the middle.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
import yaml
from nats.aio.msg import Msg

from dart.env.miniwob import MiniWoBEnv, miniwob_task
from dart.env.osworld.env import OSWorldEnv
from dart.env.osworld.providers import LocalDesktopProvider
from dart.env.osworld.suites import load_local_suite, local_solutions
from dart.env.service import EnvService, EnvServiceConfig, SlotState
from dart.env.sim.catalog import sim_task
from dart.policy.action_grammar import format_action
from dart.protocol.messages import Sampling, TaskSpec, TrajectoryStatus, Wait, WorkItem
from dart.rollout.errors import EnvFailed
from dart.rollout.service.config import RunnerConfig
from dart.rollout.service.env_client import EnvClient
from dart.rollout.service.router import EngineRouter
from dart.rollout.service.runner import TrajectoryRunner
from dart.rollout.service.scripted import ScriptedEngine
from dart.runtime.bus import Bus, BusConfig

pytestmark = pytest.mark.integration


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    config = BusConfig(url=nats_url, run="crash", connect_timeout_s=2.0, request_timeout_s=30.0)
    async with await Bus.connect(config) as connected:
        yield connected


def work_item(task: TaskSpec, max_steps: int) -> WorkItem:
    return WorkItem(
        work_id=f"w-{uuid.uuid4().hex[:8]}",
        task=task,
        group_id=f"g-{uuid.uuid4().hex[:8]}",
        rollout_index=0,
        group_size=1,
        max_steps=max_steps,
        min_policy_version=0,
        sampling=Sampling(temperature=1.0),
        created_at=time.time(),
    )


def children_of(parent: int) -> list[int]:
    """Direct children of a process, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            out.append(int(stat.parent.name))
    return out


async def wait_for(condition: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_a_browser_killed_mid_trajectory_ends_it_env_failed_and_a_spare_takes_over(bus: Bus) -> None:
    pool = f"p{uuid.uuid4().hex[:8]}"
    service = EnvService(EnvServiceConfig(pool=pool, backend="miniwob", instances=1, warm_spares=1), bus)
    await service.start()
    try:
        (instance_id,) = service.instance_ids
        await wait_for(lambda: service.spare_stats().ready == 1, 60.0)
        # Every answer is a wait: the episode runs until the browser is killed (or 40 steps).
        waiting = ScriptedEngine(["Thought: not yet\nAction: wait()"], generate_s=0.1)
        runner = TrajectoryRunner("runner-crash", bus, EngineRouter([waiting]), RunnerConfig(pool=pool))
        running = asyncio.create_task(runner.run(work_item(miniwob_task("click-test", seed=3), max_steps=40)))
        await wait_for(lambda: service.stats()[instance_id].steps >= 2)
        crashed = service.backend(instance_id)
        assert isinstance(crashed, MiniWoBEnv) and crashed.browser is not None
        browsers = children_of(crashed.browser.driver_pid)
        assert browsers
        for pid in browsers:
            os.kill(pid, signal.SIGKILL)

        trajectory = await asyncio.wait_for(running, 60.0)
        assert trajectory.status is TrajectoryStatus.ENV_FAILED
        assert trajectory.error is not None and "env_failed" in trajectory.error
        assert not trajectory.trainable

        # The lease ended with the failure; the slot is free again with the spare in it.
        stats = service.stats()[instance_id]
        assert stats.state == SlotState.FREE and stats.holder is None
        assert (stats.failures, stats.restarts) == (1, 1)
        assert service.spare_stats().used == 1
        assert service.backend(instance_id) is not crashed
        await wait_for(lambda: crashed.state == "closed")

        # The next trajectory on the same instance id runs to its end.
        finishing = ScriptedEngine(["Thought: done\nAction: finished(content='ok')"])
        runner = TrajectoryRunner("runner-next", bus, EngineRouter([finishing]), RunnerConfig(pool=pool))
        after = await runner.run(work_item(miniwob_task("click-test", seed=4), max_steps=5))
        assert after.status is TrajectoryStatus.OK and after.env_instance_id == instance_id
        await wait_for(lambda: service.spare_stats().ready == 1, 60.0)  # the spare pool refilled
    finally:
        await service.stop()


async def test_an_env_service_killed_mid_step_ends_the_step_env_failed_long_before_its_timeout(
    bus: Bus, nats_url: str, tmp_path: Path
) -> None:
    """``dart serve env`` SIGKILLed while a step is in flight (its sim step lasts an hour): the runner's
    heartbeat finds nobody serving the instance and the step ends ``env_failed`` (``no_responders``),
    although its request timeout is an hour too."""
    pool = f"p{uuid.uuid4().hex[:8]}"
    config = tmp_path / "env.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "crash", "run_dir": str(tmp_path / "run")},
                "bus": {"url": nats_url},
                "env": {
                    "pool": pool,
                    "instances": 1,
                    "heartbeat_interval_s": 1.0,
                    "sim": {
                        "latency": {
                            "step": {"kind": "constant", "seconds": 3600.0},
                            "reset": {"kind": "constant", "seconds": 0.0},
                        }
                    },
                },
                "telemetry": {"jsonl_path": str(tmp_path / "telemetry.jsonl")},
            }
        )
    )
    log = (tmp_path / "env.log").open("w")
    service = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dart.cli", "serve", "env", "--config", str(config), stdout=log, stderr=log
    )
    watcher = await nats.connect(nats_url)
    client = EnvClient(bus, "runner-gone", RunnerConfig(pool=pool, env_request_timeout_s=3600.0, lease_timeout_s=240.0))
    try:
        leasing = asyncio.create_task(client.lease())  # retries until the service serves its pool
        while not leasing.done():
            assert service.returncode is None, (tmp_path / "env.log").read_text()[-3000:]
            await asyncio.sleep(0.1)
        lease = leasing.result()
        await client.reset(sim_task("click-button", "easy", seed=1))
        sent: asyncio.Queue[bytes] = asyncio.Queue()

        async def seen(msg: Msg) -> None:
            await sent.put(msg.data)

        await watcher.subscribe(bus.subjects.env_instance(pool, lease.instance_id, "step"), cb=seen)
        await watcher.flush()
        stepping = asyncio.create_task(client.step(Wait(seconds=0.0)))
        await asyncio.wait_for(sent.get(), 60.0)  # the step request is at the broker, then at the service
        service.kill()
        await service.wait()

        with pytest.raises(EnvFailed) as failed:
            await asyncio.wait_for(stepping, 120.0)
        assert failed.value.code == "no_responders" and failed.value.instance_id == lease.instance_id
        assert "its env service is gone" in failed.value.detail
        with pytest.raises(EnvFailed):  # the lease stays lost for every later call
            await client.evaluate()
    finally:
        await client.release()
        await watcher.close()
        if service.returncode is None:
            service.kill()
            await service.wait()
        log.close()


needs_desktop = pytest.mark.skipif(
    any(shutil.which(p) is None for p in ("Xvfb", "openbox", "xterm", "mousepad")),
    reason="the local desktop's Debian programs are missing (.ci/run installs them)",
)


@needs_desktop
async def test_xvfb_killed_mid_trajectory_ends_it_env_failed_and_the_desktop_is_replaced(bus: Bus) -> None:
    pool = f"p{uuid.uuid4().hex[:8]}"
    config = EnvServiceConfig(
        pool=pool,
        backend="osworld",
        instances=1,
        warm_spares=1,
        osworld={"request_timeout_s": 10.0},
        suites=("builtin:osworld/local",),
    )
    service = EnvService(config, bus)
    await service.start()
    try:
        (instance_id,) = service.instance_ids
        await wait_for(lambda: service.spare_stats().ready == 1, 60.0)
        task = load_local_suite()[0]
        waiting = ScriptedEngine(["Thought: not yet\nAction: wait()"], generate_s=0.1)
        runner = TrajectoryRunner("runner-crash", bus, EngineRouter([waiting]), RunnerConfig(pool=pool))
        running = asyncio.create_task(runner.run(work_item(task, max_steps=40)))
        await wait_for(lambda: service.stats()[instance_id].steps >= 2)
        crashed = service.backend(instance_id)
        assert isinstance(crashed, OSWorldEnv) and isinstance(crashed.provider, LocalDesktopProvider)
        os.kill(crashed.provider.desktop.pids["xvfb"], signal.SIGKILL)

        trajectory = await asyncio.wait_for(running, 60.0)
        assert trajectory.status is TrajectoryStatus.ENV_FAILED, trajectory.error
        stats = service.stats()[instance_id]
        assert stats.state == SlotState.FREE and stats.holder is None
        assert (stats.failures, stats.restarts, service.spare_stats().used) == (1, 1, 1)
        await wait_for(lambda: crashed.state == "closed")
    finally:
        await service.stop()


@needs_desktop
async def test_a_shipped_local_desktop_task_is_solved_over_nats_by_its_script(bus: Bus) -> None:
    """The runner drives the ``osworld`` backend through the env service with the task's scripted
    actions (as an engine would answer them): reward 0 before, 1 after, status ok."""
    pool = f"p{uuid.uuid4().hex[:8]}"
    config = EnvServiceConfig(pool=pool, backend="osworld", instances=1, suites=("builtin:osworld/local",))
    service = EnvService(config, bus)
    await service.start()
    try:
        task = next(t for t in load_local_suite() if "terminal" in t.tags)
        script = local_solutions()[str(task.params["id"])]
        # Nothing done: a `finished` right away evaluates to 0.
        quitter = ScriptedEngine(["Action: finished(content='done')"])
        runner = TrajectoryRunner("runner-quit", bus, EngineRouter([quitter]), RunnerConfig(pool=pool))
        before = await runner.run(work_item(task, max_steps=5))
        assert before.status is TrajectoryStatus.OK and before.reward == 0.0
        # The script, in the model's own output format, then finished.
        outputs = [f"Thought: {thought}\nAction: {format_action(action)}" for thought, action in script]
        solver = ScriptedEngine([*outputs, "Action: finished(content='done')"])
        runner = TrajectoryRunner("runner-solve", bus, EngineRouter([solver]), RunnerConfig(pool=pool))
        after = await runner.run(work_item(task, max_steps=len(outputs) + 2))
        assert after.status is TrajectoryStatus.OK and after.reward == 1.0, after.error
        assert all(step.parse_error is None for step in after.steps)
    finally:
        await service.stop()
