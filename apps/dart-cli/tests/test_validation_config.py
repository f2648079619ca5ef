"""Held-out validation settings: a disjoint split, its own env pool, and the summary's held-out keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from dart.cli.stack.config import RunConfig, load_tasks
from dart.cli.stack.validation import heldout_summary, heldout_tasks, learning_line, train_summary
from dart.protocol.errors import ConfigError

pytestmark = pytest.mark.unit


def test_the_quickstart_split_is_disjoint_and_accepted() -> None:
    config = RunConfig(suite="builtin:train", validation={"enabled": True, "suite": "builtin:heldout"})
    held = heldout_tasks(config)
    assert len(held) == 32 and all(t.backend == "sim" for t in held)


def test_the_miniwob_split_is_disjoint_and_accepted() -> None:
    config = RunConfig(
        suite="builtin:miniwob/train",
        env={"backend": "miniwob", "pool": "miniwob"},
        validation={"enabled": True, "suite": "builtin:miniwob/heldout"},
    )
    held = heldout_tasks(config)
    assert len(held) == 16 and all(t.backend == "miniwob" for t in held)


def test_a_held_out_suite_that_shares_a_training_task_is_refused() -> None:
    config = RunConfig(suite="builtin:train", validation={"enabled": True, "suite": "builtin:train"})
    with pytest.raises(ConfigError, match="held-out task\\(s\\) are training tasks too"):
        heldout_tasks(config)


def test_validation_needs_its_own_env_pool() -> None:
    with pytest.raises(ValidationError, match="validation.pool must differ"):
        RunConfig(validation={"enabled": True, "pool": "sim"})
    assert RunConfig(validation={"enabled": False, "pool": "sim"}).validation.pool == "sim"


def test_heldout_summary_keys() -> None:
    assert heldout_summary(None) == {}
    results = [
        {"version": 0, "success": 0.25, "ci95": [0.1, 0.4], "n": 32, "successes": 8, "errors": 0, "tasks": []},
        {"version": 9, "success": 0.75, "ci95": [0.6, 0.9], "n": 32, "successes": 24, "errors": 0, "tasks": []},
    ]
    out = heldout_summary(results)
    assert [h["version"] for h in out["heldout"]] == [0, 9] and "tasks" not in out["heldout"][0]
    assert (out["heldout_success_first"], out["heldout_success_final"]) == (0.25, 0.75)
    gain = out["heldout_gain"]
    assert (gain["from_version"], gain["to_version"], gain["difference"]) == (0, 9, 0.5)
    assert 0 < gain["ci95"][0] < 0.5 < gain["ci95"][1] < 1


def test_train_split_summary_and_the_learning_line() -> None:
    assert train_summary(None) == {} and train_summary([]) == {}
    results = [
        {"version": 0, "success": 0.5, "ci95": [0.38, 0.62], "n": 64, "successes": 32, "errors": 0, "tasks": []},
        {"version": 80, "success": 0.75, "ci95": [0.63, 0.84], "n": 64, "successes": 48, "errors": 0, "tasks": []},
    ]
    out = train_summary(results)
    assert [t["version"] for t in out["train_greedy"]] == [0, 80] and "tasks" not in out["train_greedy"][0]
    gain = out["train_greedy_gain"]
    assert (gain["from_version"], gain["to_version"], gain["difference"]) == (0, 80, 0.25)
    assert 0 < gain["ci95"][0] < 0.25 < gain["ci95"][1] < 0.5
    heldout = heldout_summary([{**results[0], "success": 0.0, "ci95": [0.0, 0.11], "n": 32, "successes": 0}])
    line = learning_line({**out, **heldout})
    assert line == (
        "learning (greedy): train split v0 50% [38%, 62%] -> v80 75% [63%, 84%] (n=64); held-out v0 0% [0%, 11%] (n=32)"
    )
    assert learning_line({}) is None


def test_screenshot_retention_must_outlast_the_env_refresh() -> None:
    with pytest.raises(
        ValidationError, match=r"data.retention.image_grace_s \(600.0\) must exceed env.screenshot_refresh_s"
    ):
        RunConfig(data={"retention": {"image_grace_s": 600}}, env={"screenshot_refresh_s": 600})
    with pytest.raises(ValidationError, match="data.retention.screenshot_prefix .* must be env.screenshot_prefix"):
        RunConfig(env={"screenshot_prefix": "shots"})
    # Both moved together, or retention off: accepted.
    RunConfig(env={"screenshot_prefix": "shots"}, data={"retention": {"screenshot_prefix": "shots"}})
    RunConfig(data={"retention": {"enabled": False, "image_grace_s": 1}}, env={"screenshot_refresh_s": 600})


def test_prompt_images_are_stored_beside_the_screenshots_under_the_same_retention() -> None:
    # Unset: the env's prefix and refresh period, so moving those moves both.
    config = RunConfig(
        env={"screenshot_prefix": "shots", "screenshot_refresh_s": 10},
        data={"retention": {"screenshot_prefix": "shots", "image_grace_s": 20}},
    )
    assert (config.rollout.prompt_images.prefix, config.rollout.prompt_images.refresh_s) == ("shots", 10)
    assert config.rollout.prompt_images.offload(None).prefix == "shots"
    # Set apart from retention: refused, the setting named.
    with pytest.raises(ValidationError, match="must be rollout.prompt_images.prefix"):
        RunConfig(rollout={"prompt_images": {"prefix": "fed"}})
    with pytest.raises(ValidationError, match=r"must exceed rollout.prompt_images.refresh_s \(5000.0\)"):
        RunConfig(rollout={"prompt_images": {"refresh_s": 5000}})


def test_env_requests_must_outlast_the_env_services_op_timeout() -> None:
    with pytest.raises(
        ValidationError, match=r"rollout.runner.env_request_timeout_s \(120.0\) must exceed env.op_timeout_s \(120.0\)"
    ):
        RunConfig(rollout={"runner": {"env_request_timeout_s": 120}}, env={"op_timeout_s": 120})
    RunConfig(rollout={"runner": {"env_request_timeout_s": 121}}, env={"op_timeout_s": 120})


def test_the_rollout_services_stop_fits_within_the_runs_stop_timeout() -> None:
    # Unset, the finishing window shrinks to leave the abort window (5 s) and 5 s more.
    assert RunConfig(run={"stop_timeout_s": 30}).rollout.stop_timeout_s == 20
    assert RunConfig(run={"stop_timeout_s": 600}).rollout.stop_timeout_s == 30  # its own default fits
    with pytest.raises(ValidationError, match=r"rollout.stop_timeout_s \(25\) must leave room .* at most 20"):
        RunConfig(run={"stop_timeout_s": 30}, rollout={"stop_timeout_s": 25})
    assert RunConfig(run={"stop_timeout_s": 30}, rollout={"stop_timeout_s": 20}).rollout.stop_timeout_s == 20


def test_in_progress_must_come_well_within_the_work_consumers_ack_wait() -> None:
    from dart.rollout.service.config import RolloutConfig

    with pytest.raises(ValidationError, match=r"in_progress_interval_s \(31.0\) must be at most half"):
        RolloutConfig(in_progress_interval_s=31)
    assert RolloutConfig(in_progress_interval_s=30).in_progress_interval_s == 30


def test_runners_lease_from_the_env_pool() -> None:
    assert RunConfig(env={"pool": "desk"}).rollout.runner.pool == "desk"
    assert RunConfig(env={"pool": "desk"}, rollout={"runner": {"pool": "desk"}}).rollout.runner.pool == "desk"
    with pytest.raises(ValidationError, match=r"rollout.runner.pool \('sim'\) must be env.pool \('desk'\)"):
        RunConfig(env={"pool": "desk"}, rollout={"runner": {"pool": "sim"}})


def test_a_runs_max_steps_is_every_tasks_budget_osworld_and_held_out_included(tmp_path: Path) -> None:
    from dart.cli.stack.services import served
    from dart.data.config import CurationConfig
    from dart.data.curation import max_steps_for

    osworld = RunConfig(suite="builtin:osworld/local", env={"backend": "osworld"}, max_steps=30)
    tasks = load_tasks(osworld)
    assert tasks and {t.max_steps for t in tasks} == {30}
    assert {t.max_steps for t in load_tasks(osworld.model_copy(update={"max_steps": None}))} == {15}
    # The data manager gets the same budget, and its adaptive length works within it.
    data_config = served(RunConfig(max_steps=30, run={"run_dir": str(tmp_path)}), "data")[0]
    assert data_config.max_steps == 30  # type: ignore[attr-defined]
    assert max_steps_for(tasks[0], None, CurationConfig()) == 30
    assert max_steps_for(tasks[0], None, CurationConfig(max_steps_ceiling=20)) == 20
    # Validation episodes run on the same budget as training ones.
    quick = RunConfig(max_steps=3)
    assert {t.max_steps for t in heldout_tasks(quick)} == {3}
    with pytest.raises(ValidationError, match="max_steps"):
        RunConfig(max_steps=0)
