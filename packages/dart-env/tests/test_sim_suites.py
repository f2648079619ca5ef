"""Sim task suites: the shipped files load, are up to date, and every task in them is solvable."""

from __future__ import annotations

from collections import Counter

import pytest

from dart.env.sim import BUILTIN_SUITES, SimEnv, builtin_suite_path, generate_suite, load_builtin_suite
from dart.env.sim.catalog import suite_yaml
from dart.env.sim.families import FAMILIES, MAX_STEPS
from dart.env.suite import load_suite

pytestmark = pytest.mark.unit


def test_shipped_suites_load_with_load_suite() -> None:
    basic = load_suite(builtin_suite_path("basic"))
    smoke = load_builtin_suite("smoke")
    assert (basic.name, len(basic.tasks)) == ("sim-basic", 40)
    assert (smoke.name, len(smoke.tasks)) == ("sim-smoke", 8)
    assert Counter(t.tags[0] for t in basic.tasks) == dict.fromkeys(FAMILIES, 10)
    assert {t.tags[1] for t in basic.tasks} == {"easy", "medium", "hard"}
    assert {t.tags[1] for t in smoke.tasks} == {"easy"}
    assert not {t.task_id for t in basic.tasks} & {t.task_id for t in smoke.tasks}
    for task in basic.tasks:
        assert task.backend == "sim" and task.max_steps == MAX_STEPS[task.params["family"]]
    with pytest.raises(KeyError, match="choose one of"):
        builtin_suite_path("nope")


def test_shipped_suites_match_the_generator() -> None:
    # Fails after a change to a family or word pool: regenerate with `uv run python -m dart.env.sim`.
    for name, kwargs in BUILTIN_SUITES.items():
        assert builtin_suite_path(name).read_text() == suite_yaml(generate_suite(f"sim-{name}", **kwargs))


async def test_every_shipped_task_resets_and_is_solved_by_the_oracle() -> None:
    env = SimEnv()
    for name in BUILTIN_SUITES:
        for task in load_builtin_suite(name).tasks:
            obs, instruction = await env.reset(task)
            assert instruction == task.instruction == obs.text
            done, steps = False, 0
            while (step := env.oracle_action()) is not None:
                _, done, _ = await env.step(step[1])
                steps += 1
            assert done and steps <= task.max_steps
            reward, success, details = await env.evaluate()
            assert success and reward == 1.0, (task.task_id, details)


def test_generate_suite_options() -> None:
    suite = generate_suite("x", per_family=3, families=("select-item",), difficulties=("hard",), seed=2)
    assert [t.task_id for t in suite.tasks] == [f"sim/select-item/hard/{2000 + i}" for i in range(3)]
    assert generate_suite("x", per_family=3, seed=2) == generate_suite("x", per_family=3, seed=2)
    with pytest.raises(ValueError, match="per_family"):
        generate_suite("x", per_family=0)
