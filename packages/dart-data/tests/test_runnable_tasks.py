"""The data manager keeps the tasks its env pool runs, asked over a real nats-server, and reports the rest.

The env pool here is a responder on the pool's capability subject (an env service answers the same way;
the env package's tests run the real one against OSWorld VMs); this package never imports dart-env.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dart.data.config import DataConfig, EmissionConfig
from dart.data.service import DataService
from dart.data.tasks import runnable_on_pool
from dart.protocol.errors import EnvPoolUnreachableError, NoRunnableTaskError
from dart.protocol.messages import CapabilitiesRequest, EnvCapabilities, TaskSpec
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.store import LocalStore
from dart.runtime.telemetry import TelemetryConfig, read_jsonl, setup_telemetry

pytestmark = pytest.mark.integration

TASKS = [
    TaskSpec(task_id="calc", backend="osworld", requires=("app:libreoffice", "step:execute")),
    TaskSpec(task_id="shell", backend="osworld", requires=("app:terminal", "step:execute")),
    TaskSpec(task_id="web", backend="osworld", requires=("app:chrome", "getter:open_tabs_info", "step:execute")),
    TaskSpec(task_id="office-web", backend="osworld", requires=("app:chrome", "app:libreoffice")),
]


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    async with await Bus.connect(BusConfig(url=nats_url, run=f"caps{uuid.uuid4().hex[:8]}")) as connected:
        yield connected


async def serve_pool(bus: Bus, pool: str, *features: str, provider: str = "docker") -> None:
    async def answer(_: CapabilitiesRequest) -> EnvCapabilities:
        return EnvCapabilities(pool=pool, backend="osworld", provider=provider, features=features)

    await bus.serve(bus.subjects.env_capabilities(pool), CapabilitiesRequest, answer, queue="dart-env")


async def test_tasks_are_kept_by_what_the_pool_runs(bus: Bus) -> None:
    pool = f"p{uuid.uuid4().hex[:6]}"
    await serve_pool(bus, pool, "app:terminal", "app:libreoffice", "step:execute")
    runnable = await runnable_on_pool(bus, TASKS, pool, timeout_s=10)
    assert [t.task_id for t in runnable.tasks] == ["calc", "shell"]
    assert runnable.excluded == 2
    assert runnable.excluded_by == {"app:chrome": 2, "getter:open_tabs_info": 1}
    assert runnable.capabilities is not None and runnable.capabilities.provider == "docker"


async def test_the_pool_may_start_after_the_data_manager_asks(bus: Bus) -> None:
    pool = f"p{uuid.uuid4().hex[:6]}"
    asking = asyncio.create_task(runnable_on_pool(bus, TASKS, pool, timeout_s=30))
    await serve_pool(bus, pool, "app:terminal", "step:execute")
    assert [t.task_id for t in (await asking).tasks] == ["shell"]


async def test_no_pool_and_nothing_runnable_are_clear_errors(bus: Bus) -> None:
    pool = f"p{uuid.uuid4().hex[:6]}"
    with pytest.raises(EnvPoolUnreachableError, match=f"pool '{pool}'.*start the env service"):
        await runnable_on_pool(bus, TASKS, pool, timeout_s=0.5)
    await serve_pool(bus, pool, "app:gimp", provider="remote")
    with pytest.raises(NoRunnableTaskError, match=r"provider remote.*step:execute \(3\)"):
        await runnable_on_pool(bus, TASKS, pool, timeout_s=10)


async def test_tasks_without_requirements_need_no_pool(bus: Bus) -> None:
    plain = [TaskSpec(task_id="sim/click/0", backend="sim")]
    runnable = await runnable_on_pool(bus, plain, f"none{uuid.uuid4().hex[:6]}", timeout_s=0.1)
    assert runnable.tasks == tuple(plain) and runnable.excluded == 0


async def test_data_stats_report_the_excluded_tasks(bus: Bus, tmp_path: Path) -> None:
    pool = f"p{uuid.uuid4().hex[:6]}"
    await serve_pool(bus, pool, "app:terminal", "step:execute")
    runnable = await runnable_on_pool(bus, TASKS, pool, timeout_s=10)
    telemetry = setup_telemetry("dart-data", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path))
    config = DataConfig(database_url=f"sqlite:///{tmp_path / 'd.sqlite3'}", emission=EmissionConfig(enabled=False))
    service = DataService(
        config,
        bus,
        LocalStore(tmp_path / "store"),
        runnable.tasks,
        telemetry,
        tasks_excluded=runnable.excluded,
        tasks_excluded_by=runnable.excluded_by,
    )
    try:
        async with service:
            stats = service.stats
    finally:
        telemetry.shutdown()
    assert (stats.tasks, stats.tasks_excluded) == (1, 3)
    assert stats.tasks_excluded_by == {"app:chrome": 2, "app:libreoffice": 2, "getter:open_tabs_info": 1}
    [event] = [r["attributes"] for r in read_jsonl(telemetry.jsonl_path, types={"event"}) if r["name"] == "data.stats"]
    assert (event["tasks"], event["tasks_excluded"]) == (1, 3)
    assert event["tasks_excluded_by"]["app:chrome"] == 2
