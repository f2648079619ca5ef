"""Policy evaluation: the statistics against closed forms, and :func:`evaluate` against known outcomes.

The outcome test drives real runners over a real nats-server and env service (sim backend) with a
``ScriptedEngine`` whose answer reads the instruction in the prompt: it clicks the right button
(the sim oracle's action) on the tasks chosen to be solved and gives up on the others, so the
exact success, per-task counts and pass@k of the report are known in advance.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from itertools import combinations
from math import comb

import pytest

from dart.env.service import EnvService, EnvServiceConfig
from dart.env.sim import LatencyConfig, SimConfig, SimEnv, sim_task
from dart.policy.action_grammar import format_output
from dart.policy.config import PromptConfig
from dart.protocol.messages import Fail, Sampling, TaskSpec
from dart.rollout.engine.interface import GenerationRequest
from dart.rollout.eval import EvalReport, difference_interval, evaluate, pass_at_k, pass_ks, wilson_interval
from dart.rollout.service.config import RunnerConfig
from dart.rollout.service.router import EngineRouter
from dart.rollout.service.scripted import ScriptedEngine
from dart.runtime.bus import Bus

FAST_SIM = SimConfig(latency=LatencyConfig(scale=0.0))


@pytest.mark.unit
def test_wilson_interval_matches_published_values() -> None:
    # Reference values: Newcombe (1998), Table I, method 3 (Wilson score without continuity correction).
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert wilson_interval(15, 148) == pytest.approx((0.0624, 0.1605), abs=1e-4)
    assert wilson_interval(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)
    assert wilson_interval(1, 29) == pytest.approx((0.0061, 0.1718), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(3, 2)


@pytest.mark.unit
@pytest.mark.parametrize(("n", "c"), [(1, 0), (1, 1), (4, 1), (5, 2), (6, 6), (7, 0), (8, 3)])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_success(n: int, c: int) -> None:
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(combinations(range(n), k))
        brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(n, c, n + 1)
    assert pass_ks(1) == [1] and pass_ks(5) == [1, 2, 4, 5] and pass_ks(8) == [1, 2, 4, 8]


@pytest.fixture
async def pool(bus: Bus) -> AsyncIterator[str]:
    name = f"eval{uuid.uuid4().hex[:8]}"
    service = EnvService(EnvServiceConfig(pool=name, instances=2, sim=FAST_SIM), bus)
    await service.start()
    yield name
    await service.stop()


def distinct_click_tasks(count: int) -> list[TaskSpec]:
    """Click-button tasks whose instructions differ, so the prompt tells which task is running."""
    tasks: dict[str, TaskSpec] = {}
    seed = 9000
    while len(tasks) < count:
        task = sim_task("click-button", "easy", seed)
        tasks.setdefault(task.instruction, task)
        seed += 1
    return list(tasks.values())


async def oracle_text(task: TaskSpec) -> str:
    env = SimEnv(FAST_SIM)
    await env.reset(task)
    step = env.oracle_action()
    assert step is not None
    return format_output(*step)


async def test_evaluate_reports_exactly_the_outcomes_a_scripted_policy_produces(bus: Bus, pool: str) -> None:
    a, b, c, d = distinct_click_tasks(4)
    solve = {a.instruction: await oracle_text(a), c.instruction: await oracle_text(c)}
    give_up = format_output("I cannot find it.", Fail(reason="not found"))
    seen: dict[str, int] = {}

    def answer(request: GenerationRequest) -> str:
        instruction = next(t.instruction for t in (a, b, c, d) if t.instruction in request.prompt.text)
        seen[instruction] = seen.get(instruction, 0) + 1
        # a: always solved; c: solved on its first episode only; b, d: never.
        if instruction == a.instruction or (instruction == c.instruction and seen[instruction] == 1):
            return solve[instruction]
        return give_up

    engine = ScriptedEngine([], answer=answer)
    report = await evaluate(
        bus,
        EngineRouter([engine]),
        RunnerConfig(pool=pool, prompt=PromptConfig(max_images=1)),
        [a, b, c, d],
        episodes_per_task=2,
        sampling=Sampling(temperature=0.0),
        concurrency=2,
        label="t",
    )
    assert [(t.task_id, t.n, t.successes, t.errors) for t in report.tasks] == [
        (a.task_id, 2, 2, 0),
        (b.task_id, 2, 0, 0),
        (c.task_id, 2, 1, 0),
        (d.task_id, 2, 0, 0),
    ]
    assert (report.n, report.successes, report.success) == (8, 3, 3 / 8)
    assert report.ci95 == wilson_interval(3, 8)
    assert report.pass_at() == {1: pytest.approx(3 / 8), 2: pytest.approx(2 / 4)}
    assert all(t.mean_steps == 1.0 for t in report.tasks)
    line = report.to_dict()
    assert line["statuses"] == {"ok": 8} and line["pass_at_k"] == {"1": 0.375, "2": 0.5}
    assert [t["success"] for t in line["tasks"]] == [1.0, 0.0, 0.5, 0.0]
    # One suite's part of an evaluation that ran two together: its tasks' figures alone.
    part = report.part({b.task_id, c.task_id}, "t-part")
    assert (part.label, [t.task_id for t in part.tasks]) == ("t-part", [b.task_id, c.task_id])
    assert (part.n, part.successes, part.ci95) == (4, 1, wilson_interval(1, 4))
    assert (part.seconds, part.statuses) == (report.seconds, report.statuses)


async def test_evaluate_counts_env_failures_as_errors_not_as_failures(bus: Bus) -> None:
    # No env service serves this pool: every episode ends env_failed and is left out of the rates.
    engine = ScriptedEngine(["Thought: x\nAction: wait()"])
    report = await evaluate(
        bus,
        EngineRouter([engine]),
        RunnerConfig(pool=f"none{uuid.uuid4().hex[:6]}", lease_timeout_s=0.3, lease_backoff_max_s=0.1),
        distinct_click_tasks(2),
        episodes_per_task=1,
    )
    assert (report.n, report.errors, report.success) == (0, 2, None)
    assert report.statuses == {"env_failed": 2}
    assert report.pass_at() == {1: None}
    assert report.setup_failures == 2  # no episode ever started: none is a policy's failure


async def test_a_task_the_env_cannot_set_up_is_a_setup_failure_not_a_policy_failure(bus: Bus, pool: str) -> None:
    (good,) = distinct_click_tasks(1)
    broken = TaskSpec(task_id="sim/broken/0", backend="sim", instruction="Click OK", params={"family": "no-such"})
    engine = ScriptedEngine(["Thought: x\nAction: wait()"])
    report = await evaluate(bus, EngineRouter([engine]), RunnerConfig(pool=pool), [good, broken], episodes_per_task=1)
    by_task = {t.task_id: (t.n, t.errors, t.setup_failures) for t in report.tasks}
    assert by_task == {good.task_id: (1, 0, 0), broken.task_id: (0, 1, 1)}
    assert report.to_dict()["setup_failures"] == 1 and report.n == 1
    # The wire form carries it (the held-out validation reads the rollout service's answer).
    assert EvalReport.from_result(report.to_result("e", "scripted")).setup_failures == 1


@pytest.mark.unit
def test_difference_interval_matches_newcombe() -> None:
    # Newcombe (1998), "Interval estimation for the difference between independent proportions",
    # example (a): 56/70 vs 48/80, method 10 gives 0.0524 to 0.3339.
    assert difference_interval(48, 80, 56, 70) == pytest.approx((0.0524, 0.3339), abs=1e-4)
    low, high = difference_interval(0, 32, 0, 32)
    assert low < 0 < high
    with pytest.raises(ValueError, match="at least one"):
        difference_interval(0, 0, 1, 2)
