"""`dart run --ray local` end to end: the smoke job's services as actors on a real Ray cluster of three nodes
(separate `ray start` processes, each declaring 2 logical GPUs) inside a network namespace that has only
loopback, and the loss of a node mid-run.

The run (`examples/smoke-ray.yaml`) places the rollout service's two engines on the head's two GPUs and the
2-rank FSDP trainer as a placement group with one bundle per worker node. Once the trainer has checkpointed and
published, the test kills the worker node that holds trainer node 1 (its `ray start` process group: raylet,
agents, and with them the actors and the ranks they run). Ray declares the node dead, the supervisor sees the
trainer lost and places it anew (both ranks on the surviving worker), the trainer resumes from its checkpoint
and publishes on. The run must end with nothing lost or stored twice, and leave no Ray process behind.
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dart.runtime.telemetry import read_jsonl
from dart.runtime.testing import kill_process_tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_support  # the end-to-end tests' shared helpers, beside them

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "smoke-ray.yaml"
pytestmark = [pytest.mark.e2e, pytest.mark.warm_start(CONFIG), pytest.mark.timeout(1500)]

LOOPBACK_ONLY = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
"""Runs a command in a new network namespace whose only interface is loopback (CI runs as root)."""

AFTER_RESTART = 1
"""Versions the restarted trainer publishes before the test ends the run."""
WAIT_S = 900.0
"""Limit of one wait for a condition (catches a hung run; a loaded machine is slow, not stuck)."""

wait_for = functools.partial(e2e_support.wait_for, limit_s=WAIT_S)


def published(run_dir: Path) -> int:
    path = run_dir / "telemetry" / "train.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for r in read_jsonl(path, types={"event"}) if r["name"] == "trainer.published")


def restarted_trainer(run_dir: Path) -> bool:
    """Whether the trainer has been started a second time (``placement.json``, which may be mid-write)."""
    try:
        placement = json.loads((run_dir / "placement.json").read_text())
    except ValueError:
        return False
    return any(p["service"] == "train" and p["attempt"] == 2 for p in placement)


def processes_naming(text: str) -> list[str]:
    """Command lines of the processes that name ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


@pytest.fixture(scope="module")
def ray_run(dart_run: Callable[..., tuple[dict[str, Any], Path]]) -> tuple[dict[str, Any], Path, dict[str, Any]]:
    seen: dict[str, Any] = {}

    def lose_a_node(run: subprocess.Popen[str], runs: Path) -> None:
        run_dir = wait_for(run, lambda: next(runs.glob("*/ray-nodes.json"), None), "the local cluster").parent
        nodes = json.loads((run_dir / "ray-nodes.json").read_text())
        seen["nodes"] = nodes
        wait_for(run, lambda: list((run_dir / "checkpoints").glob("step-*")), "trainer checkpoint")
        wait_for(run, lambda: published(run_dir) >= 1, "a published version")
        # dart doctor --ray, from inside the run's network namespace, lists the cluster's nodes.
        doctor = subprocess.run(
            [
                "nsenter",
                f"--net=/proc/{run.pid}/ns/net",
                sys.executable,
                "-m",
                "dart.cli",
                "doctor",
                "--ray",
                nodes["address"],
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        seen["doctor"] = (doctor.returncode, doctor.stdout, doctor.stderr)
        placement = json.loads((run_dir / "placement.json").read_text())
        trainer_1 = next(p for p in placement if p["process"] == "trainer" and p["node"] == 1)
        seen["killed"] = trainer_1["host"]
        # The node goes at once with everything on it (raylet, agents, actors and the ranks they run).
        kill_process_tree(nodes["node_pids"][trainer_1["host"]])
        wait_for(run, lambda: restarted_trainer(run_dir), "the trainer placed anew")
        seen["published_before"] = published(run_dir)
        wait_for(
            run,
            lambda: published(run_dir) >= seen["published_before"] + AFTER_RESTART,
            f"{AFTER_RESTART} versions published by the trainer placed anew",
        )
        run.send_signal(signal.SIGINT)

    summary, run_dir = dart_run(
        CONFIG,
        args=["--ray", "local"],
        prefix=LOOPBACK_ONLY,
        env={
            # The RL phase lasts until the test has seen training go on after the loss, and ends it.
            "DART_RUN__MIN_VERSIONS": "100000",
            "DART_RUN__MAX_RL_DURATION_S": "1200",
            "DART_RUN__RESTART_BACKOFF_S": "1",
            "DART_TRAIN__CHECKPOINT_EVERY": "1",
        },
        during=lose_a_node,
        timeout_s=1400,
    )
    return summary, run_dir, seen


def test_every_engine_and_rank_got_its_own_gpu_and_the_ranks_spread(
    ray_run: tuple[dict[str, Any], Path, dict[str, Any]],
) -> None:
    summary, _, _ = ray_run
    assert summary["cluster"]["kind"] == "ray"
    assert [n["name"] for n in summary["cluster"]["nodes"]] == ["head", "worker-1", "worker-2"]
    first = [p for p in summary["placement"] if p["attempt"] == 1]
    engines = [p for p in first if p["service"] == "rollout"]
    ranks = [p for p in first if p["service"] == "train"]
    assert [(p["process"], p["host"]) for p in engines] == [("hf-engine-0", "head"), ("hf-engine-1", "head")]
    assert sorted(p["node"] for p in ranks) == [0, 1]
    assert {p["host"] for p in ranks} == {"worker-1", "worker-2"}, "the trainer's two nodes shared a machine"
    gpus = [(p["host"], d) for p in first for d in p["devices"]]
    assert len(gpus) == 4 and len(set(gpus)) == 4, f"two processes were given one GPU: {gpus}"


def test_the_trainer_lost_with_its_node_was_placed_anew_and_resumed(
    ray_run: tuple[dict[str, Any], Path, dict[str, Any]],
) -> None:
    summary, run_dir, seen = ray_run
    assert summary["error"] is None
    assert summary["rl_ended_by"] == "signal"
    assert [(r["service"], r["exit_code"]) for r in summary["service_restarts"]] == [("train", -9)]
    again = [p for p in summary["placement"] if p["service"] == "train" and p["attempt"] == 2]
    assert sorted(p["node"] for p in again) == [0, 1]
    assert seen["killed"] not in {p["host"] for p in again}
    assert "resumed from" in (run_dir / "logs" / "train.log").read_text()
    assert summary["versions_published"] >= seen["published_before"] + AFTER_RESTART
    assert summary["service_exit_codes"] == {"rollout": 0, "data": 0, "train": 0, "env": 0}


def test_nothing_lost_and_nothing_stored_twice(ray_run: tuple[dict[str, Any], Path, dict[str, Any]]) -> None:
    summary, _, _ = ray_run
    assert summary["trajectories_produced"] > 0
    assert summary["trajectories_lost"] == 0
    assert summary["trajectories_duplicated"] == 0
    assert summary["trajectories_produced"] == summary["trajectories_stored"]


def test_doctor_lists_the_nodes_and_no_ray_process_is_left(
    ray_run: tuple[dict[str, Any], Path, dict[str, Any]],
) -> None:
    _, _, seen = ray_run
    code, stdout, stderr = seen["doctor"]
    assert code == 0, stderr[-3000:]
    listed = json.loads(stdout.strip().splitlines()[-1])
    assert [n["name"] for n in listed["nodes"]] == ["head", "worker-1", "worker-2"]
    assert all(n["resources"]["GPU"] == 2 for n in listed["nodes"])
    assert processes_naming(seen["nodes"]["temp_dir"]) == []
    assert not [pid for pid in seen["nodes"]["node_pids"].values() if Path(f"/proc/{pid}").exists()]
