"""End to end on MiniWoB++: `dart run examples/miniwob.yaml` runs the four services on real web
tasks in headless Chromium (warm start from the scripted oracles, a short RL phase, rollouts branched at their
least sure step), and its own records show every trajectory came from the miniwob pool and was stored, and
that branches forked their parents in Chromium and were trained with them."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dart.cli.stack.config import load_run_config, load_tasks
from dart.env.miniwob import SOLVERS, MiniWoBEnv
from dart.env.miniwob.browser import find_binary
from dart.env.miniwob.catalog import BUILTIN_SUITES, load_builtin_suite
from dart.protocol.errors import ConfigError
from dart.runtime.telemetry import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "miniwob.yaml"
RUN_ENV = {"SE_OFFLINE": "true"}

needs_chromium = pytest.mark.skipif(
    find_binary("MINIWOB_CHROME_BINARY", "chromium", "chromium-browser") is None
    or find_binary("MINIWOB_CHROMEDRIVER", "chromedriver") is None,
    reason="Chromium and chromedriver are not installed (apt-get install chromium chromium-driver; .ci/run does)",
)


@pytest.fixture(scope="module")
def miniwob_run(dart_run: Callable[..., tuple[dict[str, Any], Path]]) -> tuple[dict[str, Any], Path]:
    return dart_run(CONFIG, env=RUN_ENV)


@pytest.mark.unit
def test_the_config_runs_the_shipped_suite_on_the_miniwob_backend() -> None:
    config = load_run_config(CONFIG)
    assert config.env.backend == "miniwob" and config.rollout.runner.pool == config.env.pool
    tasks = load_tasks(config)
    assert len(tasks) >= 5 and all(t.backend == "miniwob" for t in tasks)
    assert all(t.task_id.split("/")[1] in SOLVERS for t in tasks), "every task needs an oracle for the warm start"
    wrong = config.model_copy(update={"env": config.env.model_copy(update={"backend": "sim"})})
    with pytest.raises(ConfigError, match="env.backend is 'sim'"):
        load_tasks(wrong)


@pytest.mark.integration
@needs_chromium
@pytest.mark.parametrize("name", sorted(BUILTIN_SUITES))
async def test_shipped_suite_matches_the_pages_and_the_oracle_solves_it(name: str) -> None:
    os.environ.setdefault("SE_OFFLINE", "true")
    suite = await asyncio.to_thread(load_builtin_suite, name)
    async with MiniWoBEnv() as env:
        for task in suite.tasks:
            _, instruction = await env.reset(task)
            assert instruction == task.instruction, (
                f"{task.task_id}: regenerate with python -m dart.env.miniwob.catalog"
            )
            steps, done = 0, False
            while not done and (step := env.oracle_action()) is not None:
                _, done, _ = await env.step(step[1])
                steps += 1
            assert steps <= task.max_steps
            reward, success, details = await env.evaluate()
            assert success, f"{task.task_id}: {details}"


@pytest.mark.warm_start(CONFIG, env=RUN_ENV)
@pytest.mark.e2e
@needs_chromium
def test_summary_shows_a_complete_run(miniwob_run: tuple[dict[str, Any], Path]) -> None:
    summary, run_dir = miniwob_run
    assert summary["error"] is None
    assert summary["service_exit_codes"] == {"rollout": 0, "data": 0, "train": 0, "env": 0}
    assert summary["trajectories_produced"] > 0
    assert summary["trajectories_produced"] == summary["trajectories_stored"]
    assert summary["trajectories_lost"] == 0
    assert summary["versions_published"] >= 1
    # The warm start recorded the oracle's demonstrations on the miniwob backend itself.
    assert summary["warm_start_demos"] >= len(load_builtin_suite("smoke").tasks)
    assert (run_dir / "summary.json").is_file()


@pytest.mark.warm_start(CONFIG, env=RUN_ENV)
@pytest.mark.e2e
@needs_chromium
def test_trajectories_ran_on_miniwob_tasks_in_chromium(miniwob_run: tuple[dict[str, Any], Path]) -> None:
    _, run_dir = miniwob_run
    suite_ids = {t.task_id for t in load_builtin_suite("smoke").tasks}
    spans = [
        s for s in read_jsonl(run_dir / "telemetry" / "rollout.jsonl", types={"span"}) if s["name"] == "trajectory"
    ]
    assert spans
    assert {s["attributes"]["dart.task_id"] for s in spans} <= suite_ids
    statuses = {s["attributes"]["dart.status"] for s in spans}
    assert statuses <= {"ok", "truncated", "aborted"}, f"a trajectory failed: {statuses}"
    assert "ok" in statuses or "truncated" in statuses
    stats = [
        e["attributes"]
        for e in read_jsonl(run_dir / "telemetry" / "env.jsonl", types={"event"})
        if e["name"] == "env.instance_stats" and e["attributes"]["state"] == "stopped"
    ]
    assert {s["backend"] for s in stats} == {"miniwob"}
    assert len(stats) == load_run_config(CONFIG).env.instances
    assert sum(int(s["steps"]) for s in stats) > 0 and all(int(s["failures"]) == 0 for s in stats)


@pytest.mark.warm_start(CONFIG, env=RUN_ENV)
@pytest.mark.e2e
@needs_chromium
def test_rollouts_were_branched_by_forking_chromium_and_trained_with_their_parents(
    miniwob_run: tuple[dict[str, Any], Path],
) -> None:
    _, run_dir = miniwob_run
    events = read_jsonl(run_dir / "telemetry" / "data.jsonl", types={"event"})
    final = [e["attributes"] for e in events if e["name"] == "data.stats"][-1]
    assert final["branches"] > 0
    [forks] = [
        e["attributes"]
        for e in read_jsonl(run_dir / "telemetry" / "env.jsonl", types={"event"})
        if e["name"] == "env.forks"
    ]
    assert forks["forked"] > 0, forks
    with sqlite3.connect(run_dir / "data.sqlite3") as db:
        branches = db.execute(
            "SELECT b.trajectory_id, b.branch_step, b.group_id, p.group_id, p.num_steps, p.status FROM trajectories b "
            "JOIN trajectories p ON p.trajectory_id = b.parent_trajectory_id"
        ).fetchall()
        orphans = db.execute(
            "SELECT COUNT(*) FROM trajectories WHERE parent_trajectory_id IS NOT NULL AND parent_trajectory_id NOT IN "
            "(SELECT trajectory_id FROM trajectories)"
        ).fetchone()[0]
        trained = db.execute(
            "SELECT COUNT(*) FROM trajectories b JOIN rollout_groups g ON g.group_id = b.group_id "
            "WHERE b.parent_trajectory_id IS NOT NULL AND g.status = 'emitted'"
        ).fetchone()[0]
    assert branches and orphans == 0
    for _, step, group, parent_group, parent_steps, parent_status in branches:
        assert group == parent_group and 1 <= step < parent_steps and parent_status in ("ok", "truncated")
    assert trained > 0, "no branch reached a training batch"
