"""An env pool runs its own copy of the task a reset names, over a real nats-server: a task of its suite runs,
an altered one or one it does not have is refused and counted, and the pool serves on."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dart.env.serve import EnvServeConfig
from dart.env.service import EnvService, EnvServiceConfig
from dart.env.service.pool_tasks import altered_fields
from dart.env.sim import BUILTIN_SUITES, LatencyConfig, SimConfig, load_builtin_suite, sim_task, sim_task_from_id
from dart.protocol.errors import ConfigError, RemoteError
from dart.protocol.messages import (
    ErrorCode,
    EvaluateReply,
    EvaluateRequest,
    LeaseReply,
    LeaseRequest,
    ResetReply,
    ResetRequest,
    StepReply,
    StepRequest,
    TaskSpec,
)
from dart.protocol.suite import TaskSuite, dump_suite
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.telemetry import TelemetryConfig, read_jsonl, setup_telemetry

pytestmark = pytest.mark.integration

FAST_SIM = SimConfig(latency=LatencyConfig(scale=0.0))
SUITE = (sim_task("click-button", "easy", 7), sim_task("enter-text", "easy", 7))


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    config = BusConfig(url=nats_url, run="envtasks", connect_timeout_s=2.0, request_timeout_s=5.0)
    async with await Bus.connect(config) as connected:
        yield connected


def write_suite(path: Path, *tasks: TaskSpec) -> str:
    path.write_text(json.dumps(dump_suite(TaskSuite(name="mine", tasks=tasks))))
    return str(path)


def pool_config(**fields: Any) -> EnvServiceConfig:
    return EnvServiceConfig(pool=f"p{uuid.uuid4().hex[:8]}", instances=1, sim=FAST_SIM, **fields)


async def lease(bus: Bus, pool: str) -> LeaseReply:
    return await bus.request(bus.subjects.env_lease(pool), LeaseRequest(holder="t", ttl_s=30.0), LeaseReply)


async def reset(bus: Bus, pool: str, held: LeaseReply, task: TaskSpec) -> ResetReply:
    subject = bus.subjects.env_instance(pool, held.instance_id, "reset")
    return await bus.request(subject, ResetRequest(lease_id=held.lease_id, task=task), ResetReply)


async def refused(bus: Bus, pool: str, held: LeaseReply, task: TaskSpec) -> RemoteError:
    with pytest.raises(RemoteError) as caught:
        await reset(bus, pool, held, task)
    assert caught.value.code == ErrorCode.INVALID_REQUEST, caught.value
    return caught.value


async def solve(bus: Bus, service: EnvService, held: LeaseReply) -> float:
    """Play the instance's oracle to the end of the episode just reset; the reward."""
    pool, backend = service.config.pool, service.backend(held.instance_id)
    index = 0
    while (oracle := backend.oracle_action()) is not None:
        step = StepRequest(lease_id=held.lease_id, action=oracle[1], step_index=index)
        await bus.request(bus.subjects.env_instance(pool, held.instance_id, "step"), step, StepReply)
        index += 1
    subject = bus.subjects.env_instance(pool, held.instance_id, "evaluate")
    return (await bus.request(subject, EvaluateRequest(lease_id=held.lease_id), EvaluateReply)).reward


async def test_a_pool_runs_its_suites_tasks_and_refuses_altered_or_unknown_ones(bus: Bus, tmp_path: Path) -> None:
    telemetry = setup_telemetry("dart-env", version="1", run_id="r", config=TelemetryConfig(run_dir=tmp_path))
    config = pool_config(suites=(write_suite(tmp_path / "suite.json", *SUITE),))
    click, _ = SUITE
    try:
        async with EnvService(config, bus, telemetry=telemetry) as service:
            held = await lease(bus, config.pool)
            # Another layout under the suite's id: refused before the backend sees it.
            other_layout = click.model_copy(update={"params": {**click.params, "seed": 8}})
            error = await refused(bus, config.pool, held, other_layout)
            assert error.details["reason"] == "altered_task" and "params.seed" in error.message
            await refused(bus, config.pool, held, click.model_copy(update={"instruction": "Close every window"}))
            # A task the sim would generate, but not one of this pool's suite.
            error = await refused(bus, config.pool, held, sim_task("click-button", "easy", 8))
            assert error.details["reason"] == "unknown_task" and "suite.json" in error.message
            assert service.task_refusals == {"altered_task": 2, "unknown_task": 1}
            # The suite's task as it is, with the run's own step budget: the episode runs on the same lease.
            answer = await reset(bus, config.pool, held, click.model_copy(update={"max_steps": 30}))
            assert answer.instruction == click.instruction
            assert await solve(bus, service, held) == 1.0
            assert service.stats()[held.instance_id].failures == 0
    finally:
        telemetry.shutdown()
    events = [
        r["attributes"] for r in read_jsonl(telemetry.jsonl_path, types={"event"}) if r["name"] == "env.task_refused"
    ]
    assert [(e["reason"], e["count"]) for e in events] == [
        ("altered_task", 1),
        ("altered_task", 2),
        ("unknown_task", 1),
    ]
    assert events[0]["task_id"] == click.task_id and events[0]["pool"] == config.pool


async def test_without_suites_a_pool_runs_the_tasks_its_backend_generates_from_their_ids(bus: Bus) -> None:
    config = pool_config()
    task = sim_task("tick-boxes", "medium", 12)
    async with EnvService(config, bus) as service:
        held = await lease(bus, config.pool)
        error = await refused(bus, config.pool, held, task.model_copy(update={"params": {**task.params, "seed": 13}}))
        assert error.details["reason"] == "altered_task"
        made_up = TaskSpec(task_id="anything/1", backend="sim", params={"family": "click-button", "seed": 1})
        assert (await refused(bus, config.pool, held, made_up)).details["reason"] == "unknown_task"
        await reset(bus, config.pool, held, task)
        assert await solve(bus, service, held) == 1.0
        assert service.task_refusals == {"altered_task": 1, "unknown_task": 1}


async def test_a_suite_that_does_not_resolve_or_suit_the_backend_stops_the_start(bus: Bus, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="env.suites") as caught:
        await EnvService(pool_config(suites=(str(tmp_path / "missing.yaml"),)), bus).start()
    assert "missing.yaml" in str(caught.value)
    web = TaskSpec(task_id="miniwob/click-test", backend="miniwob", params={"env_id": "miniwob/click-test-v1"})
    with pytest.raises(ConfigError, match="for backend 'miniwob'"):
        await EnvService(pool_config(suites=(write_suite(tmp_path / "web.json", web),)), bus).start()
    clash = SUITE[0].model_copy(update={"instruction": "Click Cancel"})
    suites = (write_suite(tmp_path / "a.json", SUITE[0]), write_suite(tmp_path / "b.json", clash))
    with pytest.raises(ConfigError, match="differs between the suites"):
        await EnvService(pool_config(suites=suites), bus).start()


@pytest.mark.unit
def test_the_sim_generates_every_shipped_task_from_its_id_and_nothing_from_other_ids() -> None:
    for name in BUILTIN_SUITES:
        for task in load_builtin_suite(name).tasks:
            assert sim_task_from_id(task.task_id) == task
    for task_id in (
        "sim/click-button/easy/01",
        "sim/click-button/easy/-1",
        "sim/click-button/easy/\u0661",  # an Arabic-Indic digit
        "sim/click-button/easy/7/",
        "sim/click-button/extreme/7",
        "sim/draw-circle/easy/7",
        "sim/click-button/easy/99999999999",
        "miniwob/click-test/7",
    ):
        assert sim_task_from_id(task_id) is None, task_id


@pytest.mark.unit
def test_a_body_differs_in_anything_but_the_step_budget() -> None:
    task = TaskSpec(task_id="t", backend="osworld", params={"config": [{"n": 1}], "x": None})
    assert altered_fields(task, task.model_copy(update={"max_steps": 30})) == []
    for config in ([{"n": 1.0}], [{"n": True}], [{"n": 1}, {"n": 1}]):
        altered = task.model_copy(update={"params": {"config": config, "x": None}})
        assert altered_fields(task, altered) == ["params.config"], config
    # An absent parameter is not a null one.
    assert altered_fields(task, task.model_copy(update={"params": {"config": [{"n": 1}]}})) == ["params.x"]
    assert altered_fields(task, task.model_copy(update={"tags": ("x",), "backend": "sim"})) == ["backend", "tags"]


@pytest.mark.unit
def test_the_served_pool_runs_the_runs_suite_unless_it_names_its_own() -> None:
    served = EnvServeConfig(suite="builtin:train")
    assert served.pool().suites == ("builtin:train",)
    own = EnvServeConfig(suite="builtin:train", env=EnvServiceConfig(suites=("a.yaml", "b.yaml")))
    assert own.pool().suites == ("a.yaml", "b.yaml")
