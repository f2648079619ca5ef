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


def test_train_and_heldout_suites_have_disjoint_seeds() -> None:
    train, held = load_builtin_suite("train"), load_builtin_suite("heldout")
    assert (train.name, len(train.tasks), held.name, len(held.tasks)) == ("sim-train", 64, "sim-heldout", 32)
    assert Counter(t.tags[0] for t in train.tasks) == dict.fromkeys(FAMILIES, 16)
    assert Counter(t.tags[0] for t in held.tasks) == dict.fromkeys(FAMILIES, 8)
    seeds = {name: {t.params["seed"] for t in load_builtin_suite(name).tasks} for name in BUILTIN_SUITES}
    assert not seeds["train"] & seeds["heldout"]
    for other in ("basic", "smoke"):
        assert not seeds[other] & (seeds["train"] | seeds["heldout"])


async def test_the_oracle_solves_generated_tasks_over_many_seeds() -> None:
    env = SimEnv()
    suite = generate_suite("many", per_family=30, difficulties=("easy", "medium", "hard"), seed=7)
    first_actions: dict[str, set[str]] = {}
    for task in suite.tasks:
        await env.reset(task)
        steps = 0
        while (step := env.oracle_action()) is not None:
            if steps == 0:
                first_actions.setdefault(str(task.params["family"]), set()).add(step[1].model_dump_json())
            await env.step(step[1])
            steps += 1
        reward, success, details = await env.evaluate()
        assert success and reward == 1.0 and steps <= task.max_steps, (task.task_id, details)
    # The layout varies with the seed: the first correct action (where to click, or what to type)
    # takes many values within every family, so no fixed answer fits a family.
    assert all(len(actions) >= 10 for actions in first_actions.values()), {k: len(v) for k, v in first_actions.items()}


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
