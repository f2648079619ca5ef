"""`dart run`'s suite selection: shipped sim, MiniWoB++ and OSWorld suites, OSWorld task directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dart.cli.stack.config import RunConfig, load_run_config, load_tasks
from dart.env.osworld.suites import load_local_suite
from dart.env.osworld.support import provider_features
from dart.protocol.errors import ConfigError
from dart.protocol.messages import EnvCapabilities
from dart.runtime.capabilities import runnable_tasks

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def test_the_osworld_example_runs_the_shipped_local_suite_on_the_osworld_backend() -> None:
    config = load_run_config(ROOT / "examples" / "osworld.yaml")
    assert config.env.backend == "osworld" and config.rollout.runner.pool == config.env.pool
    tasks = load_tasks(config)
    assert [t.task_id for t in tasks] == [t.task_id for t in load_local_suite()]
    assert len(tasks) >= 8 and all(t.backend == "osworld" for t in tasks)


def test_an_osworld_directory_gives_every_task_with_what_it_requires(tmp_path: Path) -> None:
    """The suite keeps every task; which run is the env pool's to say (the data manager asks it)."""
    # Two tasks in OSWorld's layout: one runs on the local desktop, one needs Chrome's debugging port.
    runnable = {
        "id": "11111111-0000-0000-0000-000000000001",
        "instruction": "Create hello.txt in the home directory",
        "config": [{"type": "execute", "parameters": {"command": "true", "shell": True}}],
        "related_apps": ["os"],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": "ls ~/hello.txt", "shell": True},
            "expected": {"type": "rule", "rules": {"expected": "hello.txt"}},
        },
    }
    blocked = {
        "id": "11111111-0000-0000-0000-000000000002",
        "instruction": "Open two tabs",
        "config": [{"type": "chrome_open_tabs", "parameters": {"urls_to_open": ["about:blank"]}}],
        "related_apps": ["chrome"],
        "evaluator": {"func": "infeasible"},
    }
    (tmp_path / "os").mkdir()
    for task in (runnable, blocked):
        (tmp_path / "os" / f"{task['id']}.json").write_text(json.dumps(task))
    config = RunConfig(suite=f"osworld:{tmp_path}", env={"pool": "osworld", "backend": "osworld"})
    tasks = load_tasks(config)
    assert [t.task_id for t in tasks] == [f"osworld/os/{runnable['id']}", f"osworld/os/{blocked['id']}"]
    assert "step:chrome_open_tabs" in tasks[1].requires and "app:terminal" in tasks[0].requires
    local = EnvCapabilities(pool="osworld", backend="osworld", features=tuple(provider_features(config.env.osworld)))
    assert [t.task_id for t in runnable_tasks(tasks, local).tasks] == [tasks[0].task_id]

    with pytest.raises(ConfigError, match="env.backend is 'sim'"):
        load_tasks(config.model_copy(update={"env": config.env.model_copy(update={"backend": "sim"})}))
    with pytest.raises(ConfigError, match="suite"):
        load_tasks(RunConfig(suite=f"osworld:{tmp_path / 'missing'}", env={"backend": "osworld"}))


def test_dart_run_refuses_a_database_url_it_would_ignore_and_writes_nothing(tmp_path: Path) -> None:
    """dart run keeps the index in its run directory: a PostgreSQL URL in the config is refused by name,
    before any run directory exists."""
    from dart.cli.stack.run import run

    config = tmp_path / "run.yaml"
    runs = tmp_path / "runs"
    config.write_text(
        json.dumps(
            {"run": {"runs_root": str(runs)}, "data": {"database_url": "postgresql+psycopg://dart@db:5432/dart"}}
        )
    )
    with pytest.raises(ConfigError, match="data.database_url"):
        run(config)
    assert not runs.exists()


def test_the_data_manager_asks_the_runs_env_pool() -> None:
    config = RunConfig(env={"pool": "osworld", "backend": "osworld"})
    assert config.data.env_pool == "osworld"
    with pytest.raises(ValueError, match=r"data.env_pool \('other'\) must be env.pool \('osworld'\)"):
        RunConfig(env={"pool": "osworld", "backend": "osworld"}, data={"env_pool": "other"})
