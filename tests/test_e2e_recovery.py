"""Supervision end to end: services SIGKILLed in the middle of `dart run` are restarted and the run goes on.

The trainer is killed once it has checkpointed (it must resume from the checkpoint and publish newer
versions), then dart-data (it must reload its index and ingest what it had not acknowledged). The run
must end normally with every produced trajectory stored once.
"""

from __future__ import annotations

import functools
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dart.runtime.testing import kill_process_tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_support  # the end-to-end tests' shared helpers, beside them

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.e2e, pytest.mark.warm_start(ROOT / "examples" / "smoke.yaml")]
AFTER_DATA_RESTART = 2
"""Versions published after the data manager's restart before the test kills the whole run."""
AFTER_RESUME = 1
"""Versions published after the resume before the test ends the run."""
WAIT_S = 900.0
"""Limit of one wait for a condition (catches a hung run; a loaded machine is slow, not stuck)."""

wait_for = functools.partial(e2e_support.wait_for, limit_s=WAIT_S)
events = e2e_support.events


def service_pid(parent: int, service: str) -> int | None:
    """The pid of ``dart serve <service>`` started by process ``parent``, from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"serve" in argv and service.encode() in argv:
            return int(entry.name)
    return None


def published(run_dir: Path) -> list[int]:
    """The versions the trainer published, in order (both parts of a resumed run append to one file)."""
    return [int(e["attributes"]["version"]) for e in events(run_dir, "train", "trainer.published")]


def kill_and_await_restart(run: subprocess.Popen[str], service: str) -> None:
    old = wait_for(run, lambda: service_pid(run.pid, service), f"`dart serve {service}` process")
    os.kill(old, signal.SIGKILL)
    wait_for(run, lambda: (pid := service_pid(run.pid, service)) is not None and pid != old, f"restarted {service}")


@pytest.fixture(scope="module")
def killed_run(dart_run: Callable[..., tuple[dict[str, Any], Path]]) -> tuple[dict[str, Any], Path, dict[str, Any]]:
    seen: dict[str, Any] = {}

    def inject(run: subprocess.Popen[str], runs: Path) -> None:
        run_dir = wait_for(run, lambda: next(runs.glob("*/config.yaml"), None), "run directory").parent
        seen["run_dir"] = run_dir
        wait_for(run, lambda: list((run_dir / "checkpoints").glob("step-*")), "trainer checkpoint")
        seen["steps_before_kill"] = len(events(run_dir, "train", "trainer.step"))
        kill_and_await_restart(run, "train")
        # The new trainer trains: a step event after the ones seen before the kill.
        wait_for(
            run, lambda: len(events(run_dir, "train", "trainer.step")) > seen["steps_before_kill"], "step after restart"
        )
        seen["published_before_data_kill"] = count = len(published(run_dir))
        kill_and_await_restart(run, "data")
        # The restarted data manager batches again: versions trained on its batches are published. Then the
        # whole run is lost at once.
        wait_for(
            run,
            lambda: len(published(run_dir)) >= count + AFTER_DATA_RESTART,
            f"{AFTER_DATA_RESTART} versions published after the data manager's restart",
        )
        seen["killed_processes"] = kill_process_tree(run.pid)
        seen["published_before_resume"] = published(run_dir)

    def end_after_resume(run: subprocess.Popen[str], _: Path) -> None:
        # The resumed run publishes on; then the test ends the RL phase (SIGINT, as Ctrl-C would) and the
        # services stop in order.
        before = len(seen["published_before_resume"])
        wait_for(
            run, lambda: len(published(seen["run_dir"])) >= before + AFTER_RESUME, f"{AFTER_RESUME} versions resumed"
        )
        run.send_signal(signal.SIGINT)

    env = {
        "DART_RUN__NAME": "recovery",
        # The RL phase lasts until the test has seen training go on after both restarts, and ends it.
        "DART_RUN__RL_DURATION_S": "10",
        "DART_RUN__MIN_VERSIONS": "100000",
        "DART_RUN__MAX_RL_DURATION_S": "1200",
        "DART_RUN__RESTART_BACKOFF_S": "1",
        "DART_TRAIN__CHECKPOINT_EVERY": "1",
        "DART_VALIDATION__ENABLED": "false",
    }
    dart_run(ROOT / "examples" / "smoke.yaml", env=env, during=inject, killed=True)
    summary, run_dir = dart_run(None, args=["--resume", str(seen["run_dir"])], env=env, during=end_after_resume)
    return summary, run_dir, seen


def test_killed_services_are_restarted_and_the_run_completes(
    killed_run: tuple[dict[str, Any], Path, dict[str, Any]],
) -> None:
    summary, run_dir, seen = killed_run
    assert summary["error"] is None
    assert summary["rl_ended_by"] == "signal"
    restarts = summary["service_restarts"]
    assert [(r["service"], r["exit_code"]) for r in restarts] == [("train", -9), ("data", -9)]
    assert all(r["restarted_after_s"] >= r["died_after_s"] for r in restarts)
    assert summary["service_exit_codes"] == {"rollout": 0, "data": 0, "train": 0, "env": 0}
    assert seen["steps_before_kill"] >= 1
    # The restarted trainer resumed from its checkpoint and went on publishing.
    assert "resumed from" in (run_dir / "logs" / "train.log").read_text()
    assert summary["versions_published"] >= seen["published_before_data_kill"] + AFTER_DATA_RESTART


def test_a_run_killed_as_a_whole_resumes_where_it_was(
    killed_run: tuple[dict[str, Any], Path, dict[str, Any]],
) -> None:
    summary, run_dir, seen = killed_run
    assert seen["killed_processes"] >= 5  # dart run, its four services (and the servers it started)
    before = seen["published_before_resume"]
    [resumed] = summary["resumed"]
    # The run resumed at the newest version it had announced. The kill can land between a version's
    # announcement and its telemetry event (which SIGKILL loses), so that version may be one past the events.
    assert max(before) <= resumed["version"] <= max(before) + 1, (resumed, before)
    assert resumed["rl_elapsed_s"] > 0
    versions = published(run_dir)
    assert versions[: len(before)] == before
    assert versions == sorted(set(versions)), f"a version number was published twice or out of order: {versions}"
    assert len(versions) >= len(before) + AFTER_RESUME
    assert summary["versions_published"] == versions[-1]
    # The resumed trainer started from a checkpoint of the first part (not from the initial policy).
    resumes = [line for line in (run_dir / "logs" / "train.log").read_text().splitlines() if "resumed from" in line]
    assert len(resumes) >= 2, resumes  # the supervised restart, then the resume


def test_nothing_lost_and_nothing_stored_twice(killed_run: tuple[dict[str, Any], Path, dict[str, Any]]) -> None:
    summary, run_dir, _ = killed_run
    assert summary["trajectories_produced"] > 0
    assert summary["trajectories_lost"] == 0
    assert summary["trajectories_produced"] == summary["trajectories_stored"]
    con = sqlite3.connect(f"file:{run_dir / 'data.sqlite3'}?mode=ro", uri=True)
    try:
        rows, distinct = con.execute("SELECT COUNT(*), COUNT(DISTINCT trajectory_id) FROM trajectories").fetchone()
    finally:
        con.close()
    assert rows == distinct == summary["trajectories_stored"]
    # No group went into a second batch after dart-data's restart (both processes' events are in data.jsonl).
    batched = [gid for e in events(run_dir, "data", "data.batch") for gid in e["attributes"]["group_ids"]]
    assert batched and len(batched) == len(set(batched))
