"""What a crash of a whole run costs: ``dart run`` killed as a whole, then ``dart run --resume``.

Runs ``python -m dart.cli run`` on ``examples/smoke.yaml`` (checkpoints every version), waits until
``--kill-at`` versions are published, then freezes and SIGKILLs ``dart run`` and every process under it at
once (a machine's loss: nothing gets to clean up), and resumes the run with ``dart run --resume RUN_DIR``
until ``--after`` more versions are out; then ends it with SIGINT (as Ctrl-C would).

It prints, per crash:

- the work redone: the episodes in flight at the kill (work items the rollout service had started and whose
  trajectory it had not yet published: they are delivered again after the resume), their generation-seconds
  (``engine.generate`` spans) and env-seconds (``env.reset`` and ``env.step`` spans) recorded before the kill,
  and their wall-seconds from their first recorded span to the kill (an upper bound of the lost episode time);
- the trainer's steps redone (steps taken after the newest checkpoint at the kill);
- the time from ``--resume`` to the services being ready, to the first trajectory stored, and to the first
  version published after the resume;

then the run's totals (trajectories produced, stored, lost, duplicated; versions strictly increasing with no
number reused). Last line: one JSON object. Exit code 0 only when the run completed with nothing lost and
nothing duplicated, and resumed at the version it had announced.

Usage::

    uv run python benchmarks/resume.py                   # kill after version 3, resume for 3 more
    uv run python benchmarks/resume.py --kill-at 5 --after 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from efficiency import machine

from dart.runtime.telemetry import read_jsonl
from dart.runtime.testing import kill_process_tree

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "smoke.yaml"
WAIT_S = 1200.0
"""Longest wait for any one thing (a version, the run's end), seconds."""
ENV_SPANS = frozenset({"env.reset", "env.step"})


def run_env(cache: Path) -> dict[str, str]:
    """The run's settings: RL until the benchmark ends it, a checkpoint at every version, no validation."""
    return {
        **os.environ,
        "DART_RUN__NAME": "resume-bench",
        "DART_RUN__RL_DURATION_S": "10",
        "DART_RUN__MIN_VERSIONS": "100000",
        "DART_RUN__MAX_RL_DURATION_S": "3600",
        "DART_TRAIN__CHECKPOINT_EVERY": "1",
        "DART_VALIDATION__ENABLED": "false",
        "DART_WARM_START__CACHE_DIR": str(cache),
    }


def records(run_dir: Path, service: str, types: set[str]) -> list[dict[str, Any]]:
    path = run_dir / "telemetry" / f"{service}.jsonl"
    return list(read_jsonl(path, types=types)) if path.is_file() else []


def published(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in records(run_dir, "train", {"event"}) if r["name"] == "trainer.published"]


def wait_for(run: subprocess.Popen[bytes], condition: Any, what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if run.poll() is not None:
            raise SystemExit(f"dart run ended (code {run.returncode}) before {what}")
        if value := condition():
            return value
        time.sleep(0.2)
    raise SystemExit(f"no {what} within {WAIT_S:g} s")


def in_flight(run_dir: Path, kill_ns: int) -> dict[str, Any]:
    """The episodes the rollout service had started and not published at ``kill_ns``, and what they had cost.

    An episode is one work item's trace: its spans (lease, reset, generate, step, ...) share the trace id the
    data manager gave the work item, and its ``trajectory`` span ends once the trajectory is published. Spans
    are written when they end, so the cost counts the spans that ended before the kill (a lower bound), and the
    wall-seconds from each episode's first span to the kill bound it from above."""
    spans: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in records(run_dir, "rollout", {"span"}):
        if span.get("trace_id") and span["end_unix_ns"] <= kill_ns:
            spans[span["trace_id"]].append(span)
    open_traces = {t: s for t, s in spans.items() if not any(x["name"] == "trajectory" for x in s)}
    # Only work items' traces: a weight update's or a lease heartbeat's trace has no generate or env span.
    episodes = {
        t: s for t, s in open_traces.items() if any(x["name"] == "engine.generate" or x["name"] in ENV_SPANS for x in s)
    }
    return {
        "episodes_in_flight": len(episodes),
        "generation_s_redone": round(
            sum(x["duration_s"] for s in episodes.values() for x in s if x["name"] == "engine.generate"), 3
        ),
        "env_s_redone": round(sum(x["duration_s"] for s in episodes.values() for x in s if x["name"] in ENV_SPANS), 3),
        "episode_wall_s_at_most": round(
            sum((kill_ns - min(x["start_unix_ns"] for x in s)) / 1e9 for s in episodes.values()), 3
        ),
    }


def steps_redone(run_dir: Path, kill_ns: int) -> int:
    """Trainer steps taken before the kill after the newest checkpoint written before it: trained again."""
    events = [r for r in records(run_dir, "train", {"event"}) if r["ts_unix_ns"] <= kill_ns]
    steps = [int(r["attributes"]["step"]) for r in events if r["name"] == "trainer.step"]
    saved = [int(r["attributes"]["step"]) for r in events if r["name"] == "trainer.checkpoint"]
    return max(steps, default=0) - max(saved, default=0)


def first_after(run_dir: Path, service: str, name: str, after_ns: int) -> float | None:
    """Seconds from ``after_ns`` to the first event, or span end, of ``service`` after it whose name starts
    with ``name``."""
    times = [
        when
        for r in records(run_dir, service, {"event", "span"})
        if r["name"].startswith(name) and (when := r.get("ts_unix_ns") or r.get("end_unix_ns") or 0) > after_ns
    ]
    return round((min(times) - after_ns) / 1e9, 2) if times else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill-at", type=int, default=3, help="kill once this many versions are published")
    parser.add_argument("--after", type=int, default=3, help="versions to publish after the resume, then stop")
    parser.add_argument("--cache", type=Path, default=None, help="warm-start cache (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="dart-resume-bench-"))
    env = run_env(args.cache or root / "warm-start-cache")
    cmd = [sys.executable, "-m", "dart.cli", "run"]
    runs = root / "runs"
    env["DART_RUN__RUNS_ROOT"] = str(runs)

    first = subprocess.Popen([*cmd, str(CONFIG)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = wait_for(first, lambda: next(runs.glob("*/config.yaml"), None), "a run directory").parent
    wait_for(first, lambda: len(published(run_dir)) >= args.kill_at, f"version {args.kill_at}")
    kill_ns = time.time_ns()
    killed = kill_process_tree(first.pid)
    first.wait()
    before = [int(r["attributes"]["version"]) for r in published(run_dir)]
    lost_work = in_flight(run_dir, kill_ns)
    redone_steps = steps_redone(run_dir, kill_ns)

    resume_ns = time.time_ns()
    second = subprocess.Popen(
        [*cmd, "--resume", str(run_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    wait_for(second, lambda: len(published(run_dir)) >= len(before) + args.after, f"{args.after} versions resumed")
    second.send_signal(signal.SIGINT)
    out, _ = second.communicate(timeout=WAIT_S)
    summary = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    versions = [int(r["attributes"]["version"]) for r in published(run_dir)]
    resumed = (summary.get("resumed") or [{}])[0]
    result = {
        "benchmark": "resume",
        "machine": machine(),
        "kill_at_version": max(before, default=0),
        "processes_killed": killed,
        **lost_work,
        "trainer_steps_redone": redone_steps,
        "resumed_at_version": resumed.get("version"),
        "resume_to_services_ready_s": first_after(run_dir, "train", "service.ready", resume_ns),
        "resume_to_first_trajectory_stored_s": first_after(run_dir, "data", "process dart.v1.traj.", resume_ns),
        "resume_to_first_version_s": first_after(run_dir, "train", "trainer.published", resume_ns),
        "versions": versions,
        "versions_strictly_increasing": versions == sorted(set(versions)),
        "exit_code": second.returncode,
        "trajectories_produced": summary.get("trajectories_produced"),
        "trajectories_stored": summary.get("trajectories_stored"),
        "trajectories_lost": summary.get("trajectories_lost"),
        "trajectories_duplicated": summary.get("trajectories_duplicated"),
        "run_dir": str(run_dir) if args.keep else None,
    }
    print(
        f"killed {killed} processes at version {result['kill_at_version']}; in flight: "
        f"{result['episodes_in_flight']} episodes, {result['generation_s_redone']} generation-s and "
        f"{result['env_s_redone']} env-s recorded (at most {result['episode_wall_s_at_most']} episode-s); "
        f"trainer steps redone: {redone_steps}"
    )
    print(
        f"resumed at version {result['resumed_at_version']}: services ready after "
        f"{result['resume_to_services_ready_s']} s, first trajectory stored after "
        f"{result['resume_to_first_trajectory_stored_s']} s, "
        f"first version after {result['resume_to_first_version_s']} s"
    )
    print(
        f"trajectories produced {result['trajectories_produced']}, stored {result['trajectories_stored']}, lost "
        f"{result['trajectories_lost']}, duplicated {result['trajectories_duplicated']}; versions {versions}"
    )
    ok = (
        second.returncode == 0
        and summary.get("trajectories_lost") == 0
        and not summary.get("trajectories_duplicated")
        and result["versions_strictly_increasing"]
        and resumed.get("version") in (max(before, default=0), max(before, default=0) + 1)
    )
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
