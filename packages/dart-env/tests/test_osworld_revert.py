"""Every OSWorld episode starts from a clean VM, or the instance is not used again.

Against real processes: a DART desktop's VM server (Xvfb + the server) stands in for a remote VM, reverted
through its HTTP revert route or by a command; the env service runs on a real nats-server. A failed revert
ends the instance; a VM that cannot revert serves one episode, then is given back (its release command runs)
and a fresh one is acquired. The env pool answers the capability query the data manager filters tasks by.
"""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from dart.env.desktop import DesktopConfig, XDesktop
from dart.env.osworld import load_osworld_suite
from dart.env.osworld.config import OSWorldConfig
from dart.env.osworld.env import OSWorldEnv
from dart.env.osworld.errors import ProviderError
from dart.env.osworld.providers import RemoteProviderConfig
from dart.env.osworld.support import VMImage, platform_features
from dart.env.service import EnvService, EnvServiceConfig
from dart.protocol.errors import EnvPoolUnreachableError, RemoteError
from dart.protocol.messages import (
    ErrorCode,
    EvaluateReply,
    EvaluateRequest,
    LeaseReply,
    LeaseRequest,
    ReleaseReply,
    ReleaseRequest,
    ResetReply,
    ResetRequest,
    TaskSpec,
)
from dart.protocol.suite import TaskSuite, dump_suite
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.capabilities import request_capabilities, runnable_tasks
from dart.runtime.testing import wait_until

pytestmark = pytest.mark.integration

MISSING = [p for p in ("Xvfb", "openbox") if shutil.which(p) is None]
CORPUS = Path(__file__).resolve().parents[3].parent / "shared" / "osworld"

# Writes a file into the desktop's HOME: present in the episode, gone after a revert.
TASK = TaskSpec(
    task_id="osworld/test/marker",
    backend="osworld",
    instruction="leave a marker",
    params={
        "id": "marker",
        "instruction": "leave a marker",
        "config": [{"type": "execute", "parameters": {"command": ["sh", "-c", "touch $HOME/episode-marker"]}}],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": "ls $HOME"},
            "expected": {"type": "rule", "rules": {"expected": "never"}},
        },
    },
)


@pytest.fixture(scope="module")
def desktop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[XDesktop]:
    """A DART desktop whose VM server plays a remote VM (``/dart/revert`` restores its HOME)."""
    if MISSING:
        pytest.fail(f"local desktop programs missing: {MISSING} (.ci/run installs them)")
    template = tmp_path_factory.mktemp("home-template")
    with XDesktop(DesktopConfig(width=320, height=240, home_template=template)) as desk:
        yield desk


@pytest.fixture(scope="module")
def desktop_token(desktop: XDesktop, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The desktop server's token in a file, as ``remote.token_file`` names it."""
    path = tmp_path_factory.mktemp("vm-token") / "token"
    path.touch(mode=0o600)
    path.write_text(desktop.token + "\n")
    return path


def remote(token_file: Path, **settings: Any) -> OSWorldConfig:
    config = RemoteProviderConfig(token_file=str(token_file), **settings)
    return OSWorldConfig(provider="remote", remote=config, request_timeout_s=20, home_map=None)


def home_has_marker(env: OSWorldEnv) -> bool:
    client = env.client
    assert client is not None
    return "episode-marker" in str(client.execute(["ls", "-a", client_home(env)]).get("output", ""))


def client_home(env: OSWorldEnv) -> str:
    client = env.client
    assert client is not None
    return str(client.execute(["sh", "-c", "echo $HOME"]).get("output", "")).strip()


async def test_revert_url_gives_each_episode_a_clean_vm(desktop: XDesktop, desktop_token: Path) -> None:
    env = OSWorldEnv(remote(desktop_token, url=desktop.url, revert_url="{url}/dart/revert"))
    try:
        await env.reset(TASK)
        assert home_has_marker(env) and not env.spent
        await env.reset(TASK.model_copy(update={"params": {**TASK.params, "config": []}}))
        assert not home_has_marker(env), "the revert must have restored HOME"
    finally:
        await env.close()


async def test_a_desktop_without_its_token_is_refused_at_once(desktop: XDesktop, tmp_path: Path) -> None:
    wrong = tmp_path / "token"
    wrong.write_text("not-the-token")
    settings: dict[str, Any] = {"url": desktop.url, "revert_url": "{url}/dart/revert"}
    no_token = OSWorldConfig(provider="remote", remote=RemoteProviderConfig(**settings), home_map=None)
    for config in (remote(wrong, **settings), no_token):
        env = OSWorldEnv(config)
        try:
            with pytest.raises(ProviderError, match="HTTP 401"):
                await env.start()
        finally:
            await env.close()


async def test_a_failed_revert_raises(desktop: XDesktop, desktop_token: Path, tmp_path: Path) -> None:
    env = OSWorldEnv(remote(desktop_token, url=desktop.url, revert_url="{url}/dart/no-such-route"))
    try:
        await env.reset(TASK)  # a fresh VM needs no revert
        with pytest.raises(ProviderError, match="answered HTTP 404"):
            await env.reset(TASK)
    finally:
        await env.close()
    marker = tmp_path / "reverted"
    ok = OSWorldEnv(
        remote(desktop_token, url=desktop.url, revert_command=["sh", "-c", f'echo "$DART_VM_URL" >> {marker}'])
    )
    failing = OSWorldEnv(
        remote(desktop_token, url=desktop.url, revert_command=["sh", "-c", "echo disk gone >&2; exit 3"])
    )
    try:
        for env in (ok, failing):
            await env.reset(TASK)
        await ok.reset(TASK)
        assert marker.read_text().split() == [desktop.url]
        with pytest.raises(ProviderError, match="exited 3: disk gone"):
            await failing.reset(TASK)
    finally:
        await ok.close()
        await failing.close()


async def test_a_vm_that_cannot_revert_serves_one_episode(desktop: XDesktop, desktop_token: Path) -> None:
    env = OSWorldEnv(
        remote(desktop_token, acquire_command=[sys.executable, "-c", f"print('booting'); print({desktop.url!r})"])
    )
    try:
        await env.reset(TASK)
        assert env.spent
        with pytest.raises(ProviderError, match="cannot revert"):
            await env.reset(TASK)
    finally:
        await env.close()


# --- the env service ---------------------------------------------------------------------------


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    config = BusConfig(url=nats_url, run="osworld-revert", connect_timeout_s=2.0, request_timeout_s=60.0)
    async with await Bus.connect(config) as connected:
        yield connected


def service_config(osworld: OSWorldConfig, suite: Path, **fields: Any) -> EnvServiceConfig:
    """One instance of a pool whose suite is ``suite`` (the tasks it runs)."""
    return EnvServiceConfig(
        pool=f"p{uuid.uuid4().hex[:8]}",
        backend="osworld",
        instances=1,
        osworld=osworld,
        restart_backoff_s=0.0,
        suites=(str(suite),),
        **fields,
    )


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A suite file holding :data:`TASK`."""
    path = tmp_path_factory.mktemp("suite") / "marker.json"
    path.write_text(json.dumps(dump_suite(TaskSuite(name="marker", tasks=(TASK,)))))
    return path


async def episode(bus: Bus, pool: str) -> tuple[LeaseReply, ResetReply]:
    """Lease, reset and evaluate (the lease stays held)."""
    lease = await bus.request(bus.subjects.env_lease(pool), LeaseRequest(holder="t", ttl_s=60.0), LeaseReply)
    subject = bus.subjects.env_instance
    reset = await bus.request(
        subject(pool, lease.instance_id, "reset"), ResetRequest(lease_id=lease.lease_id, task=TASK), ResetReply
    )
    await bus.request(
        subject(pool, lease.instance_id, "evaluate"), EvaluateRequest(lease_id=lease.lease_id), EvaluateReply
    )
    return lease, reset


async def release(bus: Bus, pool: str, lease: LeaseReply) -> None:
    subject = bus.subjects.env_instance(pool, lease.instance_id, "release")
    await bus.request(subject, ReleaseRequest(lease_id=lease.lease_id), ReleaseReply)


async def test_service_ends_an_instance_whose_revert_failed(
    bus: Bus, desktop: XDesktop, desktop_token: Path, suite: Path
) -> None:
    config = service_config(remote(desktop_token, url=desktop.url, revert_url="{url}/dart/no-such-route"), suite)
    async with EnvService(config, bus) as service:
        instance = config.instance_id(0)
        first = service.backend(instance)
        lease, _ = await episode(bus, config.pool)
        # The same lease resets again: the revert fails, the instance is ended, never reused.
        reset = ResetRequest(lease_id=lease.lease_id, task=TASK)
        with pytest.raises(RemoteError) as err:
            await bus.request(bus.subjects.env_instance(config.pool, instance, "reset"), reset, ResetReply)
        assert err.value.code == ErrorCode.ENV_FAILED and "revert" in err.value.message
        await wait_until(lambda: service.stats()[instance].restarts == 1, timeout_s=60)
        assert service.backend(instance) is not first and first.state == "closed"
        assert service.stats()[instance].failures == 1


async def test_service_replaces_a_vm_that_cannot_revert_after_each_episode(
    bus: Bus, desktop: XDesktop, desktop_token: Path, tmp_path: Path, suite: Path
) -> None:
    released = tmp_path / "released"
    acquire = [sys.executable, "-c", f"print({desktop.url!r})"]
    give_back = ["sh", "-c", f'echo "$DART_VM_URL" >> {released}']
    config = service_config(remote(desktop_token, acquire_command=acquire, release_command=give_back), suite)
    async with EnvService(config, bus) as service:
        instance = config.instance_id(0)
        first = service.backend(instance)
        lease, _ = await episode(bus, config.pool)
        await release(bus, config.pool, lease)
        await wait_until(lambda: service.stats()[instance].recycles == {"single_use": 1}, timeout_s=60)
        await wait_until(lambda: released.exists() and released.read_text().split() == [desktop.url], timeout_s=30)
        assert service.backend(instance) is not first
        lease, _ = await episode(bus, config.pool)  # the fresh VM runs the next episode
        await release(bus, config.pool, lease)
        await wait_until(lambda: service.stats()[instance].recycles == {"single_use": 2}, timeout_s=60)
        assert service.stats()[instance].failures == 0


async def test_env_pool_says_what_it_runs_and_the_data_manager_keeps_those_tasks(
    bus: Bus, desktop: XDesktop, desktop_token: Path, suite: Path
) -> None:
    if not (CORPUS / "examples").is_dir():
        pytest.fail(f"the OSWorld task corpus is missing: expected {CORPUS}/examples beside the repository")
    config = service_config(remote(desktop_token, url=desktop.url, revert_url="{url}/dart/revert"), suite)
    tasks = load_osworld_suite(CORPUS).tasks
    async with EnvService(config, bus):
        caps = await request_capabilities(bus, config.pool, timeout_s=30)
        assert (caps.pool, caps.backend, caps.provider) == (config.pool, "osworld", "remote")
        assert set(caps.features) == platform_features(VMImage())
        runnable = runnable_tasks(tasks, caps)
    # The VM image has LibreOffice, Chrome and GIMP: their tasks are not dropped for want of the app.
    assert not any(name.startswith("app:") for name in runnable.excluded_by)
    assert 0 < len(runnable.tasks) < len(tasks) and runnable.excluded == len(tasks) - len(runnable.tasks)
    assert any("app:libreoffice" in t.requires for t in runnable.tasks)
    with pytest.raises(EnvPoolUnreachableError, match="start the env service"):
        await request_capabilities(bus, config.pool, timeout_s=0.5)  # the service has stopped


async def test_the_pool_runs_its_suites_copy_of_a_task_and_refuses_an_altered_one(
    bus: Bus, desktop: XDesktop, desktop_token: Path, suite: Path
) -> None:
    forged = f"forged-{uuid.uuid4().hex[:8]}"
    extra_setup = {"type": "execute", "parameters": {"command": ["sh", "-c", f"touch $HOME/{forged}"]}}
    with_extra_setup = TASK.model_copy(
        update={"params": {**TASK.params, "config": [*TASK.params["config"], extra_setup]}}
    )
    stealing = {**TASK.params["evaluator"], "result": {"type": "vm_file", "path": "/etc/shadow", "dest": "shadow"}}
    with_other_getter = TASK.model_copy(update={"params": {**TASK.params, "evaluator": stealing}})
    config = service_config(remote(desktop_token, url=desktop.url, revert_url="{url}/dart/revert"), suite)
    async with EnvService(config, bus) as service:
        lease = await bus.request(bus.subjects.env_lease(config.pool), LeaseRequest(holder="t", ttl_s=60.0), LeaseReply)
        subject = bus.subjects.env_instance(config.pool, lease.instance_id, "reset")
        unknown = TASK.model_copy(update={"task_id": "osworld/test/not-in-the-suite"})
        for task, reason, field in (
            (with_extra_setup, "altered_task", "params.config"),
            (with_other_getter, "altered_task", "params.evaluator"),
            (unknown, "unknown_task", "marker.json"),
        ):
            with pytest.raises(RemoteError) as err:
                await bus.request(subject, ResetRequest(lease_id=lease.lease_id, task=task), ResetReply)
            assert err.value.code == ErrorCode.INVALID_REQUEST and err.value.details["reason"] == reason
            assert field in err.value.message
        assert service.task_refusals == {"altered_task": 2, "unknown_task": 1}
        backend = service.backend(lease.instance_id)
        assert isinstance(backend, OSWorldEnv) and backend.client is not None
        assert forged not in str(backend.client.execute(["ls", "-a", client_home(backend)]).get("output", ""))
        # The suite's task, on the same lease: its setup runs (the marker) and its episode evaluates.
        await bus.request(subject, ResetRequest(lease_id=lease.lease_id, task=TASK), ResetReply)
        assert home_has_marker(backend)
        evaluate = bus.subjects.env_instance(config.pool, lease.instance_id, "evaluate")
        await bus.request(evaluate, EvaluateRequest(lease_id=lease.lease_id), EvaluateReply)
        assert service.stats()[lease.instance_id].failures == 0
