"""The MiniWoB++ backend hosted by the env service over a real nats-server: episodes and crashes."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dart.env.miniwob import MiniWoBEnv, miniwob_task
from dart.env.miniwob.browser import find_binary
from dart.env.service import EnvService, EnvServiceConfig
from dart.protocol.errors import RemoteError
from dart.protocol.messages import (
    Action,
    Click,
    ErrorCode,
    EvaluateReply,
    EvaluateRequest,
    InlineImage,
    LeaseReply,
    LeaseRequest,
    Observation,
    ReleaseReply,
    ReleaseRequest,
    ResetReply,
    ResetRequest,
    StepReply,
    StepRequest,
    TaskSpec,
)
from dart.runtime.bus import Bus, BusConfig

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        find_binary("MINIWOB_CHROME_BINARY", "chromium", "chromium-browser") is None
        or find_binary("MINIWOB_CHROMEDRIVER", "chromedriver") is None,
        reason="Chromium and chromedriver are not installed (apt-get install chromium chromium-driver; .ci/run does)",
    ),
]


@pytest.fixture(autouse=True)
def _selenium_offline() -> None:
    # The service hosts the built-in ``miniwob`` registration; Selenium Manager must never download.
    os.environ.setdefault("SE_OFFLINE", "true")


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    config = BusConfig(url=nats_url, run="miniwob", connect_timeout_s=2.0, request_timeout_s=20.0)
    async with await Bus.connect(config) as connected:
        yield connected


@pytest.fixture
async def service(bus: Bus) -> AsyncIterator[EnvService]:
    config = EnvServiceConfig(pool=f"mw{uuid.uuid4().hex[:8]}", backend="miniwob", instances=1, restart_backoff_s=0.1)
    async with EnvService(config, bus) as running:
        yield running


class Client:
    """What a trajectory runner sends, straight through ``bus.request``."""

    def __init__(self, bus: Bus, pool: str) -> None:
        self.bus = bus
        self.pool = pool

    async def lease(self, timeout_s: float = 30.0) -> LeaseReply:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    request = LeaseRequest(holder="runner-0", ttl_s=60.0)
                    return await self.bus.request(self.bus.subjects.env_lease(self.pool), request, LeaseReply)
                except RemoteError as exc:
                    if exc.code != ErrorCode.UNAVAILABLE:
                        raise
                    await asyncio.sleep(0.1)

    async def reset(
        self,
        lease: LeaseReply,
        task: TaskSpec,
        seed: int,
        replay: list[Action] | None = None,
        expect: list[str | None] | None = None,
    ) -> ResetReply:
        request = ResetRequest(
            lease_id=lease.lease_id, task=task, seed=seed, replay=replay or [], expect_sha256=expect or []
        )
        return await self.bus.request(self._at(lease, "reset"), request, ResetReply)

    async def step(self, lease: LeaseReply, action: Action, index: int) -> StepReply:
        request = StepRequest(lease_id=lease.lease_id, action=action, step_index=index)
        return await self.bus.request(self._at(lease, "step"), request, StepReply)

    async def evaluate(self, lease: LeaseReply) -> EvaluateReply:
        request = EvaluateRequest(lease_id=lease.lease_id)
        return await self.bus.request(self._at(lease, "evaluate"), request, EvaluateReply)

    async def release(self, lease: LeaseReply) -> ReleaseReply:
        return await self.bus.request(self._at(lease, "release"), ReleaseRequest(lease_id=lease.lease_id), ReleaseReply)

    def _at(self, lease: LeaseReply, op: str) -> str:
        return self.bus.subjects.env_instance(self.pool, lease.instance_id, op)  # type: ignore[arg-type]


async def solve_over_nats(client: Client, service: EnvService, task: TaskSpec, seed: int) -> EvaluateReply:
    """Lease, follow the instance's oracle, evaluate, release."""
    lease = await client.lease()
    assert (lease.backend, lease.screen_width, lease.screen_height) == ("miniwob", 160, 210)
    reset = await client.reset(lease, task, seed)
    assert reset.observation.text == reset.instruction != ""
    backend = service.backend(lease.instance_id)
    steps, done = 0, False
    while not done and (oracle := backend.oracle_action()) is not None:
        done = (await client.step(lease, oracle[1], steps)).done
        steps += 1
    assert done
    evaluation = await client.evaluate(lease)
    assert (await client.release(lease)).released
    return evaluation


def browser_pids(env: MiniWoBEnv) -> list[int]:
    """The browser processes chromedriver started for ``env`` (its direct children)."""
    assert env.browser is not None
    driver = env.browser.driver_pid
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == driver:  # fields after the command: state, ppid, ...
            children.append(int(stat.parent.name))
    return children


async def test_oracle_episodes_over_nats(bus: Bus, service: EnvService) -> None:
    client = Client(bus, service.config.pool)
    for name in ("click-test", "click-button", "enter-text"):
        evaluation = await solve_over_nats(client, service, miniwob_task(name), seed=21)
        assert (evaluation.reward, evaluation.success) == (1.0, True), name
        assert evaluation.details["raw_reward"] == 1.0


async def test_a_killed_browser_fails_the_episode_and_the_instance_is_replaced(bus: Bus, service: EnvService) -> None:
    client = Client(bus, service.config.pool)
    lease = await client.lease()
    crashed = service.backend(lease.instance_id)
    assert isinstance(crashed, MiniWoBEnv)
    await client.reset(lease, miniwob_task("click-test"), seed=1)
    pids = browser_pids(crashed)
    assert pids
    for pid in pids:  # the browser this test's service started
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(RemoteError) as caught:
        await client.step(lease, Click(x=0.3, y=0.6), 0)
    assert caught.value.code == ErrorCode.ENV_FAILED
    with pytest.raises(RemoteError) as again:
        await client.evaluate(lease)
    assert again.value.code == ErrorCode.ENV_FAILED

    evaluation = await solve_over_nats(client, service, miniwob_task("click-test"), seed=2)  # a new browser
    assert evaluation.success
    assert service.backend(lease.instance_id) is not crashed and crashed.state == "closed"
    assert service.stats()[lease.instance_id].restarts == 1


async def test_a_browser_past_its_memory_limit_is_recycled_between_episodes(bus: Bus) -> None:
    """The instance's memory is its browser's (chromedriver and every descendant, from /proc); past
    ``recycle.max_rss_mib`` it is swapped for a fresh browser after the episode, not during it."""
    config = EnvServiceConfig(
        pool=f"mw{uuid.uuid4().hex[:8]}", backend="miniwob", instances=1, recycle={"max_rss_mib": 50.0}
    )
    async with EnvService(config, bus) as service:
        client = Client(bus, config.pool)
        worn = service.backend(f"{config.pool}-0")
        assert (await solve_over_nats(client, service, miniwob_task("click-test"), seed=3)).success
        lease = await client.lease()  # after the swap: a fresh browser, the old one closed
        stats = service.stats()[lease.instance_id]
        assert stats.recycles == {"memory": 1} and stats.restarts == 0
        assert service.backend(lease.instance_id) is not worn and worn.state == "closed"
        await client.release(lease)
        assert service.stats()[lease.instance_id].rss_mib > 50.0  # a Chromium is far above 50 MiB


def digest(observation: Observation) -> str:
    assert isinstance(observation.screenshot, InlineImage)
    return hashlib.sha256(observation.screenshot.png).hexdigest()


async def test_a_fork_resets_the_same_task_and_seed_and_replays_to_the_same_screens(
    bus: Bus, service: EnvService
) -> None:
    """MiniWoB++ forks by replay in a real Chromium: the same task and seed, then the parent's actions, pass
    through byte-identical screenshots, and the forked page goes on to the parent's success; a screen of
    another seed is refused as ``fork_mismatch``, counted."""
    client = Client(bus, service.config.pool)
    task = miniwob_task("login-user")
    lease = await client.lease()
    screens = [digest((await client.reset(lease, task, seed=21)).observation)]
    actions: list[Action] = []
    backend = service.backend(lease.instance_id)
    while (oracle := backend.oracle_action()) is not None and len(actions) < 3:
        reply = await client.step(lease, oracle[1], len(actions))
        actions.append(oracle[1])
        screens.append(digest(reply.observation))
    assert len(actions) == 3 and not reply.done and len(set(screens)) == 4

    forked = await client.reset(lease, task, seed=21, replay=actions, expect=screens)
    assert [digest(o) for o in forked.replayed] == screens[1:]
    index, done = 0, False
    while not done and (oracle := backend.oracle_action()) is not None:
        done = (await client.step(lease, oracle[1], index)).done
        index += 1
    assert done and (await client.evaluate(lease)).success

    other = digest((await client.reset(lease, task, seed=22)).observation)
    assert other != screens[0]
    with pytest.raises(RemoteError) as refused:
        await client.reset(lease, task, seed=21, replay=actions, expect=[other, *screens[1:]])
    assert refused.value.code == ErrorCode.CONFLICT and refused.value.details["reason"] == "fork_mismatch"
    assert service.forks == {"forked": 1, "fork_mismatch": 1}
    assert service.capabilities is not None and "fork" in service.capabilities.features
    assert (await client.release(lease)).released
