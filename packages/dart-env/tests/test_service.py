"""The env service over a real nats-server: leases, episodes, expiry, crashes, bad input."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import ValidationError

from dart.env.errors import InstanceIdTakenError
from dart.env.interface import ENV_BACKENDS, EnvBackend
from dart.env.service import (
    EnvService,
    EnvServiceConfig,
    SlotState,
    SpareStats,
)
from dart.env.sim import LatencyConfig, SimConfig, SimEnv, sim_task
from dart.protocol.errors import ConfigError, NoRespondersError, RemoteError
from dart.protocol.messages import (
    Action,
    ErrorCode,
    EvaluateReply,
    EvaluateRequest,
    Finished,
    HeartbeatReply,
    HeartbeatRequest,
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
    Wait,
)
from dart.protocol.messages.observation import MetadataValue
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.telemetry import TelemetryConfig, load_busy_intervals, read_jsonl, setup_telemetry

pytestmark = pytest.mark.integration

FAST_SIM = SimConfig(latency=LatencyConfig(scale=0.0))


class CrashOnWait(SimEnv):
    """A sim env (it runs sim tasks) whose step crashes on a ``wait`` action, like a dying browser."""

    async def step(self, action: Action) -> tuple[Observation, bool, dict[str, MetadataValue]]:
        if isinstance(action, Wait):
            raise RuntimeError("simulated browser crash")
        return await super().step(action)


class HangOnWait(SimEnv):
    """A sim env whose step never returns on a ``wait`` action."""

    async def step(self, action: Action) -> tuple[Observation, bool, dict[str, MetadataValue]]:
        if isinstance(action, Wait):
            await asyncio.sleep(3600)
        return await super().step(action)


class SlowerEachStep(SimEnv):
    """A sim env whose every step takes 5 ms longer than the one before, like a browser filling up."""

    async def step(self, action: Action) -> tuple[Observation, bool, dict[str, MetadataValue]]:
        self.delay_s = getattr(self, "delay_s", 0.0) + 0.005
        await asyncio.sleep(self.delay_s)
        return await super().step(action)


class SimWithoutFork(SimEnv):
    """A sim env that does not declare forking (as the desktop and OSWorld do not)."""

    forks = False


class SlowStartCrashOnWait(CrashOnWait):
    """Takes 2 s to start (like a browser or a desktop) and crashes on ``wait``."""

    starts: ClassVar[int] = 0

    async def start(self) -> None:
        type(self).starts += 1
        await asyncio.sleep(2.0)
        await super().start()


@pytest.fixture(autouse=True)
def _test_backends() -> Iterator[None]:
    ENV_BACKENDS.register("crash-on-wait", lambda cfg, stream: CrashOnWait(cfg.sim, stream=stream), replace=True)
    ENV_BACKENDS.register("hang-on-wait", lambda cfg, stream: HangOnWait(cfg.sim, stream=stream), replace=True)
    ENV_BACKENDS.register(
        "slow-crash-on-wait", lambda cfg, stream: SlowStartCrashOnWait(cfg.sim, stream=stream), replace=True
    )
    ENV_BACKENDS.register("slower-each-step", lambda cfg, stream: SlowerEachStep(cfg.sim, stream=stream), replace=True)
    ENV_BACKENDS.register("sim-no-fork", lambda cfg, stream: SimWithoutFork(cfg.sim, stream=stream), replace=True)
    yield
    ENV_BACKENDS.unregister("sim-no-fork")
    ENV_BACKENDS.unregister("slower-each-step")
    ENV_BACKENDS.unregister("crash-on-wait")
    ENV_BACKENDS.unregister("hang-on-wait")
    ENV_BACKENDS.unregister("slow-crash-on-wait")


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    config = BusConfig(url=nats_url, run="envsvc", connect_timeout_s=2.0, request_timeout_s=5.0)
    async with await Bus.connect(config) as connected:
        yield connected


@pytest.fixture
async def make_service(bus: Bus) -> AsyncIterator[Callable[..., EnvService]]:
    """Builds services on a pool name unique to the test (instance ids are global on the server)."""
    created: list[EnvService] = []

    def make(**overrides: Any) -> EnvService:
        fields: dict[str, Any] = {"pool": f"p{uuid.uuid4().hex[:8]}", "instances": 1, "sim": FAST_SIM}
        fields.update(overrides)
        service = EnvService(EnvServiceConfig(**fields), bus)
        created.append(service)
        return service

    yield make
    for service in created:  # a failed test must not leave instances serving
        await service.stop()


class Client:
    """The calls a trajectory runner makes, straight through ``bus.request``."""

    def __init__(self, bus: Bus, pool: str) -> None:
        self.bus = bus
        self.pool = pool

    async def lease(self, ttl_s: float = 30.0, holder: str = "runner-0") -> LeaseReply:
        request = LeaseRequest(holder=holder, ttl_s=ttl_s)
        return await self.bus.request(self.bus.subjects.env_lease(self.pool), request, LeaseReply)

    async def lease_eventually(self, timeout_s: float = 5.0) -> LeaseReply:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    return await self.lease()
                except RemoteError as exc:
                    if exc.code != ErrorCode.UNAVAILABLE:
                        raise
                    await asyncio.sleep(0.02)

    async def reset(
        self,
        lease: LeaseReply,
        task: TaskSpec,
        replay: list[Action] | None = None,
        expect: list[str | None] | None = None,
    ) -> ResetReply:
        request = ResetRequest(lease_id=lease.lease_id, task=task, replay=replay or [], expect_sha256=expect or [])
        return await self.bus.request(self._at(lease, "reset"), request, ResetReply)

    async def step(self, lease: LeaseReply, action: Action, index: int) -> StepReply:
        request = StepRequest(lease_id=lease.lease_id, action=action, step_index=index)
        return await self.bus.request(self._at(lease, "step"), request, StepReply)

    async def evaluate(self, lease: LeaseReply) -> EvaluateReply:
        return await self.bus.request(
            self._at(lease, "evaluate"), EvaluateRequest(lease_id=lease.lease_id), EvaluateReply
        )

    async def heartbeat(self, lease: LeaseReply) -> HeartbeatReply:
        return await self.bus.request(
            self._at(lease, "heartbeat"), HeartbeatRequest(lease_id=lease.lease_id), HeartbeatReply
        )

    async def release(self, lease: LeaseReply) -> ReleaseReply:
        return await self.bus.request(self._at(lease, "release"), ReleaseRequest(lease_id=lease.lease_id), ReleaseReply)

    def _at(self, lease: LeaseReply, op: Any) -> str:
        return self.bus.subjects.env_instance(self.pool, lease.instance_id, op)


async def run_episode(client: Client, service: EnvService, task: TaskSpec) -> tuple[float, int]:
    """Lease, solve ``task`` with the instance's oracle, evaluate, release; returns (reward, steps)."""
    lease = await client.lease_eventually()
    reset = await client.reset(lease, task)
    assert reset.instruction == task.instruction
    backend = service.backend(lease.instance_id)
    steps = 0
    done = False
    while (oracle := backend.oracle_action()) is not None:
        assert not done
        reply = await client.step(lease, oracle[1], steps)
        steps += 1
        done = reply.done
    assert done
    evaluation = await client.evaluate(lease)
    assert (await client.release(lease)).released
    return evaluation.reward, steps


async def expect_error(code: ErrorCode, call: Any) -> RemoteError:
    with pytest.raises(RemoteError) as caught:
        await call
    assert caught.value.code == code, caught.value
    return caught.value


async def test_full_episode_over_nats(bus: Bus, make_service: Callable[..., EnvService]) -> None:
    async with make_service(instances=2) as service:
        client = Client(bus, service.config.pool)
        lease = await client.lease()
        assert lease.instance_id in service.instance_ids == [f"{service.config.pool}-0", f"{service.config.pool}-1"]
        assert (lease.screen_width, lease.screen_height) == (224, 224) and lease.backend == "sim"
        await client.release(lease)

        reward, steps = await run_episode(client, service, sim_task("tick-boxes", "medium", 3))
        assert reward == 1.0 and steps >= 2
        stats = service.stats()
        assert sum(s.steps for s in stats.values()) == steps
        assert sum(s.resets for s in stats.values()) == 1
        assert sum(s.leases_granted for s in stats.values()) == 2
        assert all(s.state == SlotState.FREE and s.failures == 0 for s in stats.values())
        busy = [s.busy_s for s in stats.values() if s.steps]
        assert set(busy[0]) == {"reset", "step", "evaluate"}


async def test_lease_exhaustion_is_unavailable_until_a_release(
    bus: Bus, make_service: Callable[..., EnvService]
) -> None:
    async with make_service(instances=2) as service:
        client = Client(bus, service.config.pool)
        first, second = await client.lease(), await client.lease()
        assert first.instance_id != second.instance_id
        error = await expect_error(ErrorCode.UNAVAILABLE, client.lease())
        assert error.retryable
        assert (await client.release(first)).released
        third = await client.lease()
        assert third.instance_id == first.instance_id and third.lease_id != first.lease_id


async def test_calls_need_the_current_lease(bus: Bus, make_service: Callable[..., EnvService]) -> None:
    async with make_service() as service:
        client = Client(bus, service.config.pool)
        lease = await client.lease()
        task = sim_task("click-button", "easy", 1)
        forged = lease.model_copy(update={"lease_id": "not-my-lease"})
        await expect_error(ErrorCode.CONFLICT, client.reset(forged, task))
        await expect_error(ErrorCode.CONFLICT, client.heartbeat(forged))
        # The right lease still works, and a step before the reset is a state conflict, not a crash.
        await expect_error(ErrorCode.CONFLICT, client.step(lease, Wait(), 0))
        await client.reset(lease, task)
        await expect_error(ErrorCode.CONFLICT, client.step(lease, Wait(seconds=0), 5))
        first = await client.step(lease, Wait(seconds=0), 0)
        again = await client.step(lease, Wait(seconds=0), 0)  # a retried step is answered, not re-run
        assert again == first and service.stats()[lease.instance_id].steps == 1
        assert (await client.release(lease)).released
        # After release the old lease is gone: not_found on calls, released=False on a second release.
        await expect_error(ErrorCode.NOT_FOUND, client.evaluate(lease))
        assert not (await client.release(lease)).released
        await expect_error(ErrorCode.NOT_FOUND, client.heartbeat(forged))


async def test_a_lease_without_heartbeats_expires(bus: Bus, make_service: Callable[..., EnvService]) -> None:
    async with make_service(reap_interval_s=0.05) as service:
        client = Client(bus, service.config.pool)
        lease = await client.lease(ttl_s=0.3)
        assert lease.heartbeat_interval_s == pytest.approx(0.1)
        await client.reset(lease, sim_task("click-button", "easy", 2))
        await asyncio.sleep(0.6)
        slot = service.stats()[lease.instance_id]
        assert slot.state == SlotState.FREE and slot.leases_expired == 1  # freed by the reaper
        await expect_error(ErrorCode.EXPIRED, client.step(lease, Wait(), 0))
        await expect_error(ErrorCode.EXPIRED, client.heartbeat(lease))
        assert not (await client.release(lease)).released
        assert (await client.lease()).instance_id == lease.instance_id


async def test_heartbeats_keep_a_lease_alive(bus: Bus, make_service: Callable[..., EnvService]) -> None:
    async with make_service(reap_interval_s=0.05) as service:
        client = Client(bus, service.config.pool)
        lease = await client.lease(ttl_s=0.5)
        await client.reset(lease, sim_task("click-button", "easy", 2))
        for _ in range(10):  # 1 s in all, twice the ttl
            await asyncio.sleep(0.1)
            beat = await client.heartbeat(lease)
            assert beat.expires_at > lease.expires_at
        await client.step(lease, Wait(seconds=0), 0)
        assert service.stats()[lease.instance_id].leases_expired == 0
        await expect_error(ErrorCode.UNAVAILABLE, client.lease())
        assert (await client.release(lease)).released


async def test_a_crash_fails_the_episode_and_the_instance_is_replaced(
    bus: Bus, make_service: Callable[..., EnvService]
) -> None:
    async with make_service(backend="crash-on-wait") as service:
        client = Client(bus, service.config.pool)
        lease = await client.lease()
        crashed = service.backend(lease.instance_id)
        await client.reset(lease, sim_task("click-button", "easy", 4))
        error = await expect_error(ErrorCode.ENV_FAILED, client.step(lease, Wait(), 0))
        assert error.details["instance_id"] == lease.instance_id
        # The failed lease stays failed: the runner's next call says env_failed too.
        await expect_error(ErrorCode.ENV_FAILED, client.evaluate(lease))
        assert not (await client.release(lease)).released

        fresh = await client.lease_eventually()
        assert fresh.instance_id == lease.instance_id  # same slot, same id, new backend
        assert service.backend(fresh.instance_id) is not crashed and crashed.state == "closed"
        await client.release(fresh)
        reward, _ = await run_episode(client, service, sim_task("click-button", "easy", 4))
        assert reward == 1.0
        stats = service.stats()[lease.instance_id]
        assert (stats.failures, stats.restarts) == (1, 1)


async def test_a_warm_spare_replaces_a_crashed_instance_without_a_start(
    bus: Bus, make_service: Callable[..., EnvService]
) -> None:
    async with make_service(backend="slow-crash-on-wait", warm_spares=1) as service:
        for _ in range(100):  # the spare starts in the background after the pool serves
            if service.spare_stats().ready == 1:
                break
            await asyncio.sleep(0.05)
        assert service.spare_stats().ready == 1
        spare = service._keeper.spares.ready[0]
        starts_before = SlowStartCrashOnWait.starts
        client = Client(bus, service.config.pool)
        lease = await client.lease()
        await client.reset(lease, sim_task("click-button", "easy", 4))
        await expect_error(ErrorCode.ENV_FAILED, client.step(lease, Wait(), 0))
        # The slot took the started spare: it is leasable now, and no backend has started since.
        fresh = await client.lease()
        assert fresh.instance_id == lease.instance_id
        assert service.backend(fresh.instance_id) is spare
        assert SlowStartCrashOnWait.starts == starts_before + 1  # only the new spare, still starting
        assert service.spare_stats().used == 1
        await client.release(fresh)
        reward, _ = await run_episode(client, service, sim_task("click-button", "easy", 4))
        assert reward == 1.0
        for _ in range(100):
            if service.spare_stats().ready == 1:
                break
            await asyncio.sleep(0.05)
        assert service.spare_stats() == SpareStats(target=1, ready=1, used=1, start_failures=0)
        assert service.stats()[lease.instance_id].restarts == 1


async def test_a_backend_that_keeps_crashing_is_retired(bus: Bus, make_service: Callable[..., EnvService]) -> None:
    async with make_service(backend="crash-on-wait", max_consecutive_failures=2) as service:
        client = Client(bus, service.config.pool)
        task = sim_task("click-button", "easy", 4)
        for _ in range(2):
            lease = await client.lease_eventually()
            await client.reset(lease, task)
            await expect_error(ErrorCode.ENV_FAILED, client.step(lease, Wait(), 0))
        await asyncio.sleep(0.1)  # closing the crashed backend (instant for sim) precedes retiring
        assert service.stats()[lease.instance_id].state == SlotState.RETIRED
        await expect_error(ErrorCode.UNAVAILABLE, client.lease())


async def test_a_hung_backend_times_out_as_env_failed(bus: Bus, make_service: Callable[..., EnvService]) -> None:
    async with make_service(backend="hang-on-wait", op_timeout_s=0.2) as service:
        client = Client(bus, service.config.pool)
        lease = await client.lease()
        await client.reset(lease, sim_task("click-button", "easy", 4))
        error = await expect_error(ErrorCode.ENV_FAILED, client.step(lease, Wait(), 0))
        assert "timed out" in error.message
        assert (await client.lease_eventually()).instance_id == lease.instance_id


async def test_invalid_requests_are_answered_and_serving_goes_on(
    bus: Bus, make_service: Callable[..., EnvService]
) -> None:
    async with make_service() as service:
        client = Client(bus, service.config.pool)
        lease = await client.lease()
        step_subject = bus.subjects.env_instance(service.config.pool, lease.instance_id, "step")
        # A message of the wrong type on a subject fails schema validation.
        with pytest.raises(RemoteError) as caught:
            await bus.request(step_subject, EvaluateRequest(lease_id=lease.lease_id), StepReply)
        assert caught.value.code == ErrorCode.INVALID_REQUEST
        # A task for another backend is rejected by the backend, without failing the instance.
        other = TaskSpec(task_id="web/1", backend="miniwob", instruction="click", params={}, max_steps=3)
        await expect_error(ErrorCode.INVALID_REQUEST, client.reset(lease, other))
        bad_params = sim_task("click-button", "easy", 1).model_copy(update={"params": {"family": "nope"}})
        await expect_error(ErrorCode.INVALID_REQUEST, client.reset(lease, bad_params))
        await client.release(lease)
        assert service.stats()[lease.instance_id].failures == 0
        reward, _ = await run_episode(client, service, sim_task("enter-text", "easy", 1))
        assert reward == 1.0


async def test_concurrent_episodes_on_four_instances(bus: Bus, make_service: Callable[..., EnvService]) -> None:
    async with make_service(instances=4) as service:
        client = Client(bus, service.config.pool)
        families = ["click-button", "enter-text", "tick-boxes", "select-item"]
        results = await asyncio.gather(
            *(run_episode(client, service, sim_task(family, "medium", i)) for i, family in enumerate(families))  # type: ignore[arg-type]
        )
        assert [reward for reward, _ in results] == [1.0] * 4
        stats = service.stats()
        assert all(s.leases_granted == 1 and s.resets == 1 for s in stats.values())


async def test_two_processes_cannot_serve_the_same_instance_ids(
    bus: Bus, make_service: Callable[..., EnvService]
) -> None:
    async with make_service() as first:
        pool = first.config.pool
        with pytest.raises(InstanceIdTakenError):
            await make_service(pool=pool).start()
        # With distinct prefixes both serve the pool; the lease subject is shared in a queue group.
        async with make_service(pool=pool, instance_prefix=f"{pool}-b") as second:
            client = Client(bus, pool)
            # A lease request reaches one member of the group; one that is full answers unavailable
            # (retryable), and the retry may reach the other.
            leases = [await client.lease_eventually(), await client.lease_eventually()]
            assert {lease.instance_id for lease in leases} == {first.instance_ids[0], second.instance_ids[0]}


async def test_an_unknown_backend_is_refused_naming_the_field_and_the_registered_ones(bus: Bus) -> None:
    with pytest.raises(ValidationError, match=r"unknown env backend 'nope'; registered: .*miniwob, osworld, sim"):
        EnvServiceConfig(backend="nope")
    # One registered after the config was written and gone by the time the service starts: named at start.
    ENV_BACKENDS.register("fleeting", lambda cfg, stream: SimEnv(cfg.sim, stream=stream))
    config = EnvServiceConfig(backend="fleeting")
    ENV_BACKENDS.unregister("fleeting")
    with pytest.raises(ConfigError) as caught:
        EnvService(config, bus)
    assert caught.value.field == "env.backend" and "unknown env backend 'fleeting'" in str(caught.value)


async def test_stop_ends_leases_and_closes_backends(bus: Bus, make_service: Callable[..., EnvService]) -> None:
    service = make_service(instances=2)
    await service.start()
    client = Client(bus, service.config.pool)
    lease = await client.lease()
    backends: list[EnvBackend] = [service.backend(i) for i in service.instance_ids]
    await service.stop()
    await service.stop()  # idempotent
    assert all(b.state == "closed" for b in backends)
    assert all(s.state == SlotState.STOPPED for s in service.stats().values())
    with pytest.raises(NoRespondersError):  # nobody serves the pool any more
        await client.lease()
    with pytest.raises(NoRespondersError):
        await client.heartbeat(lease)


async def test_busy_time_reaches_telemetry(bus: Bus, tmp_path: Path) -> None:
    telemetry = setup_telemetry("dart-env", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path))
    config = EnvServiceConfig(pool=f"p{uuid.uuid4().hex[:8]}", instances=1, sim=FAST_SIM)
    try:
        async with EnvService(config, bus, telemetry=telemetry) as service:
            reward, _ = await run_episode(Client(bus, config.pool), service, sim_task("click-button", "easy", 5))
            assert reward == 1.0
    finally:
        telemetry.shutdown()
    intervals = load_busy_intervals(telemetry.jsonl_path)
    assert {i.resource_id for i in intervals} == {f"{config.pool}-0"}
    assert {i.activity for i in intervals} == {"reset", "step", "evaluate"}


async def test_failures_replacements_and_instance_counters_reach_telemetry(bus: Bus, tmp_path: Path) -> None:
    telemetry = setup_telemetry("dart-env", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path))
    config = EnvServiceConfig(pool=f"p{uuid.uuid4().hex[:8]}", backend="crash-on-wait", instances=1, sim=FAST_SIM)
    try:
        async with EnvService(config, bus, telemetry=telemetry):
            client = Client(bus, config.pool)
            lease = await client.lease()
            await client.reset(lease, sim_task("click-button", "easy", 4))
            await expect_error(ErrorCode.ENV_FAILED, client.step(lease, Wait(), 0))
            await client.lease_eventually()  # the replacement is in place
    finally:
        telemetry.shutdown()
    events = {r["name"]: r["attributes"] for r in read_jsonl(telemetry.jsonl_path, types={"event"})}
    instance_id = f"{config.pool}-0"
    assert events["env.instance_failed"]["instance_id"] == instance_id
    assert events["env.instance_failed"]["op"] == "step"
    assert "simulated browser crash" in events["env.instance_failed"]["error"]
    assert events["env.instance_replaced"]["from_spare"] is False
    stats = events["env.instance_stats"]
    assert (stats["instance_id"], stats["resets"], stats["failures"], stats["restarts"]) == (instance_id, 1, 1, 1)
    assert stats["busy_s"]["reset"] > 0 and stats["idle_s"] >= 0


async def test_large_screenshots_travel_by_reference_stored_once(bus: Bus, tmp_path: Path) -> None:
    from dart.protocol.messages import ImageRef, InlineImage
    from dart.runtime.store import LocalStore, get_by_uri

    store = LocalStore(tmp_path / "artifacts", fsync=False)
    sim = SimConfig(width=640, height=360, latency=LatencyConfig(scale=0.0))
    task = sim_task("click-button", "easy", 1)
    config = EnvServiceConfig(pool=f"p{uuid.uuid4().hex[:8]}", instances=1, sim=sim, inline_max_bytes=1024)
    async with EnvService(config, bus, store=store) as service:
        client = Client(bus, config.pool)
        lease = await client.lease_eventually()
        first = (await client.reset(lease, task)).observation.screenshot
        again = (await client.reset(lease, task)).observation.screenshot  # the same screen
        await client.release(lease)
    assert isinstance(first, ImageRef) and (first.width, first.height) == (640, 360)
    assert again == first
    png = get_by_uri(first.uri)
    assert len(png) > 1024 and first.uri.endswith(f"screenshots/{first.sha256}.png")
    assert service.screenshots.stored == 1 and service.screenshots.referenced == 2
    assert [info.key for info in store.list("screenshots/")] == [f"screenshots/{first.sha256}.png"]

    # Under the threshold, or without a store, screenshots stay inline.
    small = EnvServiceConfig(pool=f"p{uuid.uuid4().hex[:8]}", instances=1, sim=FAST_SIM)
    async with EnvService(small, bus, store=store):
        client = Client(bus, small.pool)
        lease = await client.lease_eventually()
        assert isinstance((await client.reset(lease, task)).observation.screenshot, InlineImage)
        await client.release(lease)
    unstored = config.model_copy(update={"pool": f"p{uuid.uuid4().hex[:8]}"})
    async with EnvService(unstored, bus):
        client = Client(bus, unstored.pool)
        lease = await client.lease_eventually()
        assert isinstance((await client.reset(lease, task)).observation.screenshot, InlineImage)
        await client.release(lease)


async def test_a_screenshot_handed_out_is_never_older_than_the_refresh_period(tmp_path: Path) -> None:
    """Retention deletes unreferenced screenshots older than its grace period: the offload rewrites one it
    would hand out once its last write is older than ``refresh_s``, whoever wrote it."""
    from dart.env.service.screenshots import ScreenshotOffload
    from dart.protocol.messages import ImageRef, InlineImage, Observation
    from dart.runtime.store import LocalStore
    from dart.runtime.testing import tiny_png

    store = LocalStore(tmp_path / "artifacts", fsync=False)
    now = [time.time()]
    offload = ScreenshotOffload(store, 0, refresh_s=600.0, clock=lambda: now[0])
    shot = Observation(screenshot=InlineImage(png=tiny_png(5, 4), width=5, height=4))

    first = (await offload.observation(shot)).screenshot
    assert isinstance(first, ImageRef) and offload.stored == 1
    key = first.uri.removeprefix(store.uri("k")[:-1])
    written = store.stat(key).modified
    assert written is not None

    now[0] += 300  # within the period: handed out as it is, no write
    assert (await offload.observation(shot)).screenshot == first and offload.stored == 1
    now[0] += 400  # 700 s after the write: rewritten before it is handed out again
    assert (await offload.observation(shot)).screenshot == first and offload.stored == 2
    rewritten = store.stat(key).modified
    assert rewritten is not None and rewritten >= written

    # Another service (nothing remembered) finds it written "long ago" by its own clock: rewritten too;
    # one that finds it freshly written hands it out as it is.
    late = ScreenshotOffload(store, 0, refresh_s=600.0, clock=lambda: time.time() + 3600)
    await late.observation(shot)
    fresh = ScreenshotOffload(store, 0, refresh_s=600.0)
    await fresh.observation(shot)
    assert (late.stored, fresh.stored) == (1, 0)


async def test_an_instance_is_recycled_after_its_episodes_by_a_warm_spare(bus: Bus, tmp_path: Path) -> None:
    """After ``recycle.after_episodes`` episodes the backend is swapped between leases: the next lease gets
    the warm spare at once, under the same instance id, and the swap is counted and traced."""
    telemetry = setup_telemetry("dart-env", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path))
    config = EnvServiceConfig(
        pool=f"p{uuid.uuid4().hex[:8]}", instances=1, sim=FAST_SIM, warm_spares=1, recycle={"after_episodes": 2}
    )
    try:
        async with EnvService(config, bus, telemetry=telemetry) as service:
            client = Client(bus, config.pool)
            instance_id = f"{config.pool}-0"
            for _ in range(600):  # the spare starts in the background after the pool serves
                if service.spare_stats().ready == 1:
                    break
                await asyncio.sleep(0.05)
            spare = service._keeper.spares.ready[0]
            first = service.backend(instance_id)
            for seed in (1, 2):
                reward, _ = await run_episode(client, service, sim_task("click-button", "easy", seed))
                assert reward == 1.0
            lease = await client.lease()  # at once: no backend had to start
            assert service.backend(instance_id) is spare and first.state == "closed"
            stats = service.stats()[instance_id]
            assert (stats.recycles, stats.episodes, stats.restarts, stats.failures) == ({"episodes": 1}, 0, 0, 0)
            await client.release(lease)
            reward, _ = await run_episode(client, service, sim_task("click-button", "easy", 3))
            assert reward == 1.0 and service.stats()[instance_id].episodes == 1
    finally:
        telemetry.shutdown()
    events = [r for r in read_jsonl(telemetry.jsonl_path, types={"event"}) if r["name"] == "env.instance_recycled"]
    assert [
        (e["attributes"]["reason"], e["attributes"]["episodes"], e["attributes"]["from_spare"]) for e in events
    ] == [("episodes", 2, True)]


async def test_an_instance_whose_steps_slow_down_is_recycled(bus: Bus, make_service: Callable[..., EnvService]) -> None:
    """Steps 5 ms slower each time: the mean of the latest 3 over that of the first 3 passes 2.0 and the
    backend is swapped for a fresh (fast again) one, started since no spare is kept."""
    async with make_service(
        backend="slower-each-step", recycle={"max_step_latency_ratio": 2.0, "latency_window": 3}
    ) as service:
        client = Client(bus, service.config.pool)
        instance_id = f"{service.config.pool}-0"
        first = service.backend(instance_id)
        for seed in range(1, 20):
            await run_episode(client, service, sim_task("tick-boxes", "medium", seed))
            if service.stats()[instance_id].recycles:
                break
        await client.release(await client.lease_eventually())  # the fresh one is in
        assert service.stats()[instance_id].recycles == {"slow_steps": 1}
        assert service.backend(instance_id) is not first
        assert service.stats()[instance_id].step_latency_ratio == 1.0  # the fresh backend's own figures


@pytest.mark.unit
def test_memory_counts_a_process_and_all_its_descendants() -> None:
    import subprocess
    import sys

    from dart.env.service.health import processes_rss_mib

    # A shell whose child (a Python) holds 100 MiB: the shell's tree is that heavy, the shell alone is not.
    child = "b = bytearray(100 * 1024 * 1024); import time; time.sleep(60)"
    proc = subprocess.Popen(["sh", "-c", f"{sys.executable} -c '{child}'; exit 0"])
    try:
        deadline = time.monotonic() + 60
        while processes_rss_mib([proc.pid]) < 100 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_rss_mib([proc.pid]) >= 100
        assert processes_rss_mib([]) == 0.0
    finally:
        subprocess.run(["pkill", "-P", str(proc.pid)], check=False)
        proc.kill()
        proc.wait()


def digest(observation: Observation) -> str:
    assert isinstance(observation.screenshot, InlineImage)
    return hashlib.sha256(observation.screenshot.png).hexdigest()


async def test_a_fork_replays_an_episode_to_the_same_screens_and_a_different_one_is_refused(
    bus: Bus, make_service: Callable[..., EnvService]
) -> None:
    """A reset with a replay (the fork of a branch) reaches the parent's state on another instance, screen by
    screen; a screen that differs, an action that ends the episode, or a backend that does not fork is refused
    ``conflict`` with the reason, counted, and the lease stays for a plain reset."""
    task = sim_task("tick-boxes", "hard", 1)
    async with make_service(instances=2) as service:
        assert service.capabilities is not None and "fork" in service.capabilities.features
        client = Client(bus, service.config.pool)
        parent = await client.lease()
        screens = [digest((await client.reset(parent, task)).observation)]
        actions: list[Action] = []
        oracle = service.backend(parent.instance_id).oracle_action
        while (step := oracle()) is not None and len(actions) < 3:
            reply = await client.step(parent, step[1], len(actions))
            assert not reply.done
            actions.append(step[1])
            screens.append(digest(reply.observation))
        assert len(actions) == 3 and len(set(screens)) == 4  # every action changed the screen

        child = await client.lease()  # the other instance: the fork does not need the parent's
        assert child.instance_id != parent.instance_id
        forked = await client.reset(child, task, replay=actions, expect=[screens[0], None, screens[2], screens[3]])
        assert [digest(forked.observation)] + [digest(o) for o in forked.replayed] == screens
        # The forked state goes on as the parent's would: the oracle finishes the task from there.
        child_oracle = service.backend(child.instance_id).oracle_action
        index = 0
        while (step := child_oracle()) is not None:
            done = (await client.step(child, step[1], index)).done
            index += 1
        assert done and (await client.evaluate(child)).success

        wrong = [*screens[:3], screens[0]]  # the last screen is not the parent's
        refused = await expect_error(ErrorCode.CONFLICT, client.reset(child, task, replay=actions, expect=wrong))
        assert refused.details["reason"] == "fork_mismatch" and "after replayed action 2" in refused.message
        ended = await expect_error(ErrorCode.CONFLICT, client.reset(child, task, replay=[*actions, Finished()]))
        assert ended.details["reason"] == "fork_ended"
        # The lease is still the holder's: a plain reset starts a normal episode.
        assert digest((await client.reset(child, task)).observation) == screens[0]
        assert service.forks == {"forked": 1, "fork_mismatch": 1, "fork_ended": 1}
        assert all(s.failures == 0 and s.restarts == 0 for s in service.stats().values())
        with pytest.raises(ValidationError, match="one digest per screen"):
            ResetRequest(lease_id="x", task=task, replay=actions, expect_sha256=screens[:2])

    async with make_service(backend="sim-no-fork") as plain:
        assert plain.capabilities is not None and "fork" not in plain.capabilities.features
        client = Client(bus, plain.config.pool)
        lease = await client.lease()
        unsupported = await expect_error(ErrorCode.CONFLICT, client.reset(lease, task, replay=actions))
        assert unsupported.details["reason"] == "fork_unsupported"
        assert plain.forks == {"fork_unsupported": 1}
