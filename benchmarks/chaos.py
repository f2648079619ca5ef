"""Chaos: one ``dart run`` while every part of it is killed at random times; nothing may be lost or doubled.

Runs ``python -m dart.cli run`` on ``examples/smoke.yaml`` (sim suite, the four services as processes,
an embedded nats-server and, by default, the embedded S3 server for artifacts) and, once the rollout
service is serving, injects one fault of each kind at times drawn from ``--seed`` (spread over the RL
phase, at least ``MIN_GAP_S`` apart, in a random order):

- ``kill-<service>`` for env, data, train, rollout: SIGKILL of the ``dart serve`` process (``dart run``
  restarts it, see ``dart.cli.stack.supervisor``); the sim env backend runs inside the env service, so
  killing the service kills its backends too;
- ``kill-nats``: SIGKILL of nats-server (``dart run`` restarts it on the same port and JetStream store);
- ``stop-s3``: the S3 server (SeaweedFS, every process of it) frozen with SIGSTOP for ``S3_OUTAGE_S``
  seconds, then SIGCONT: requests hang, then fail, then go through again;
- ``kill-engine`` (``--engine vllm`` only): SIGKILL of one vLLM server (the rollout service restarts it);
- ``kill-backend`` (``--env miniwob`` only): SIGKILL of one headless Chromium under the env service (the
  episode on it fails as ``env_failed``; the instance is replaced);
- ``freeze-rollout``: the rollout service (and its engines) frozen with SIGSTOP for ``FREEZE_S`` seconds,
  longer than its env leases' heartbeats and its work items' ``in_progress`` keepalive, then SIGCONT: its
  leases expire, its work is redelivered, and the episodes it was running end explicitly when it wakes.

It prints, per fault: when it hit, what was killed, trajectories stored and versions published until the
next fault, and the time to recover (until a trajectory was ingested AND a version was published after
it); then totals: work items emitted, trajectories produced, stored, failed explicitly (by status), lost
(produced - stored), duplicated (work items stored more than once), versions, and whether the run
completed (exit 0, no error). Last line: one JSON object. Exit code 0 only when every fault was injected
and the run completed with nothing lost and nothing duplicated.

Usage::

    uv run python benchmarks/chaos.py --quick          # 240 s of RL (more when more faults need room)
    uv run python benchmarks/chaos.py --quick --engine vllm --env miniwob   # every fault
    uv run python benchmarks/chaos.py --seed 7 --rl-seconds 600 --no-s3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from efficiency import machine

from dart.runtime.telemetry import read_jsonl

REPO = Path(__file__).resolve().parent.parent
MIN_GAP_S = 25.0
"""Least time between two faults, seconds (each gets a chance to recover before the next)."""
S3_OUTAGE_S = 30.0
"""How long the S3 server stays frozen."""
FREEZE_S = 45.0
"""How long a frozen service stays stopped: past an env lease's heartbeat ttl (30 s) and a work item's
``in_progress`` interval."""
SERVICES = ("env", "data", "train", "rollout")


@dataclass
class Fault:
    """One injected fault.

    Attributes:
        kind: ``kill-<service>``, ``kill-nats``, ``stop-s3``, ``kill-engine``, ``kill-backend`` or
            ``freeze-rollout``.
        offset_s: Planned time after the rollout service became ready, seconds.
        at_unix: When it was injected, Unix seconds (None: its target was not found).
        pids: The processes signalled.
        note: Why it was skipped, if it was.
    """

    kind: str
    offset_s: float
    at_unix: float | None = None
    pids: list[int] = field(default_factory=list)
    note: str | None = None


def children(parent: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the processes whose parent is ``parent``, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and argv:
            out.append((int(entry.name), argv))
    return out


def targets(run_pid: int, kind: str) -> list[int]:
    """The pids a fault signals."""
    kids = children(run_pid)
    if kind.startswith("kill-") and kind[5:] in SERVICES:
        service = kind[5:]
        return [pid for pid, argv in kids if "serve" in argv and service in argv][:1]
    if kind == "kill-nats":
        return [pid for pid, argv in kids if Path(argv[0]).name == "nats-server"]
    if kind == "stop-s3":
        return [pid for pid, argv in kids if Path(argv[0]).name == "weed"]
    if kind == "kill-engine":
        rollout = targets(run_pid, "kill-rollout")
        servers = [pid for pid, argv in children(rollout[0]) if any("vllm" in a for a in argv)] if rollout else []
        return servers[:1]
    if kind == "kill-backend":
        # chromedriver is the env service's child; the browser it started is chromedriver's.
        env = targets(run_pid, "kill-env")
        drivers = [pid for pid, argv in children(env[0]) if "chromedriver" in Path(argv[0]).name] if env else []
        browsers = [pid for pid, argv in children(drivers[0]) if "chrom" in Path(argv[0]).name] if drivers else []
        return browsers[:1]
    if kind == "freeze-rollout":
        rollout = targets(run_pid, "kill-rollout")
        return rollout + [pid for pid, _ in children(rollout[0])] if rollout else []  # with its engines
    raise ValueError(f"unknown fault {kind}")


def schedule(kinds: list[str], rl_s: float, seed: int) -> list[Fault]:
    """Fault times from ``seed``: one per slot of the RL phase's middle 80 %, jittered, in random order."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    start, span = 0.1 * rl_s, 0.7 * rl_s
    slot = span / len(order)
    if slot < MIN_GAP_S:
        raise SystemExit(f"{len(order)} faults need at least {len(order) * MIN_GAP_S / 0.7:.0f} s of RL")
    jitter = slot - MIN_GAP_S
    return [Fault(k, round(start + i * slot + rng.uniform(0, jitter), 1)) for i, k in enumerate(order)]


def ready_at(run_dir: Path) -> float | None:
    """When the rollout service reported ready, Unix seconds."""
    path = run_dir / "telemetry" / "rollout.jsonl"
    if not path.is_file():
        return None
    for r in read_jsonl(path, types={"event"}):
        if r["name"] == "service.ready":
            return int(r["ts_unix_ns"]) / 1e9
    return None


def inject(run: subprocess.Popen[bytes], runs: Path, faults: list[Fault], earlier: set[Path]) -> None:
    """Wait for the rollout service, then inject each fault at its time (this thread's job).

    ``earlier``: run directories that existed before this run started (never this run's).
    """
    run_dir = None
    while run.poll() is None and run_dir is None:
        run_dir = next((p.parent for p in runs.glob("*/config.yaml") if p.parent not in earlier), None)
        time.sleep(0.5)
    t0 = None
    while run.poll() is None and run_dir is not None and (t0 := ready_at(run_dir)) is None:
        time.sleep(0.5)
    if t0 is None:
        return
    for fault in faults:
        delay = t0 + fault.offset_s - time.time()
        if delay > 0:
            time.sleep(delay)
        if run.poll() is not None:
            fault.note = "the run had ended"
            continue
        pids = targets(run.pid, fault.kind)
        if not pids:
            fault.note = "no such process (not part of this run)"
            continue
        fault.at_unix, fault.pids = time.time(), pids
        print(f"[chaos] {fault.kind} at +{fault.offset_s:.0f}s: pids {pids}", file=sys.stderr, flush=True)
        if fault.kind in ("stop-s3", "freeze-rollout"):
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(S3_OUTAGE_S if fault.kind == "stop-s3" else FREEZE_S)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        else:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)


def run_config(rl_s: float, s3: bool, engine: str, env: str, runs: Path, cache: Path) -> dict[str, Any]:
    """``examples/smoke.yaml`` (``examples/miniwob.yaml`` for MiniWoB++) for the chaos run."""
    base = "miniwob.yaml" if env == "miniwob" else "smoke.yaml"
    cfg: dict[str, Any] = yaml.safe_load((REPO / "examples" / base).read_text())
    cfg["run"].update(
        {
            "name": "chaos",
            "runs_root": str(runs),
            "rl_duration_s": rl_s,
            "max_rl_duration_s": rl_s + 600,
            "min_versions": 0,
            "max_restarts": 3,
            "restart_backoff_s": 1.0,
            "artifacts": "embedded_s3" if s3 else "local",
        }
    )
    cfg["validation"] = {"enabled": False}
    cfg.pop("telemetry", None)
    cfg.setdefault("warm_start", {})["cache_dir"] = str(cache)
    cfg.setdefault("train", {})["checkpoint_every"] = 2  # a killed trainer resumes from a checkpoint
    if engine == "vllm":
        python = REPO / ".venv-vllm" / "bin" / "python"
        cfg["rollout"]["engine"] = {"kind": "vllm", "launch": {"python": str(python), "kv_cache_gib": 1}}
    return cfg


def account(run_dir: Path, summary: dict[str, Any], faults: list[Fault]) -> dict[str, Any]:
    """Per-fault and total figures from the run's index, telemetry and summary."""
    con = sqlite3.connect(f"file:{run_dir / 'data.sqlite3'}?mode=ro", uri=True)
    try:
        emitted = con.execute("SELECT COALESCE(SUM(group_size), 0) FROM rollout_groups").fetchone()[0]
        by_status = dict(con.execute("SELECT status, COUNT(*) FROM trajectories GROUP BY status").fetchall())
        doubled = con.execute(
            "SELECT COUNT(*) FROM (SELECT work_id FROM trajectories GROUP BY work_id HAVING COUNT(*) > 1)"
        ).fetchone()[0]
        ingested = sorted(t for (t,) in con.execute("SELECT ingested_at FROM trajectories").fetchall())
    finally:
        con.close()
    published = sorted(
        int(r["ts_unix_ns"]) / 1e9
        for r in read_jsonl(run_dir / "telemetry" / "train.jsonl", types={"event"})
        if r["name"] == "trainer.published"
    )
    hit = [f for f in faults if f.at_unix is not None]
    rows = []
    for f in faults:
        row: dict[str, Any] = asdict(f)
        if f.at_unix is not None:
            at = f.at_unix
            later = [g.at_unix for g in hit if g.at_unix is not None and g.at_unix > at]
            until = min(later) if later else float("inf")
            next_ingest = next((t for t in ingested if t > at), None)
            next_version = next((t for t in published if t > at), None)
            recovered = None if next_ingest is None or next_version is None else max(next_ingest, next_version)
            row.update(
                {
                    "recover_s": None if recovered is None else round(recovered - at, 1),
                    "versions_before": sum(1 for t in published if t <= at),
                    "versions_until_next_fault": sum(1 for t in published if at < t <= until),
                    "stored_until_next_fault": sum(1 for t in ingested if at < t <= until),
                }
            )
        rows.append(row)
    failed = {s: n for s, n in by_status.items() if s not in ("ok", "truncated")}
    return {
        "faults": rows,
        "totals": {
            "work_items_emitted": int(emitted),
            "trajectories_produced": summary.get("trajectories_produced"),
            "trajectories_stored": summary.get("trajectories_stored"),
            "trajectories_by_status": by_status,
            "failed_explicitly": sum(failed.values()),
            "lost": summary.get("trajectories_lost"),
            "duplicated": int(doubled),
            "versions_published": summary.get("versions_published"),
            "service_restarts": summary.get("service_restarts"),
        },
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{'fault':<14}{'at +s':>7}{'pids':>14}{'recover s':>11}{'versions':>10}{'+versions':>11}{'+stored':>9}"]
    for r in result["faults"]:
        if r["at_unix"] is None:
            lines.append(f"{r['kind']:<14}{r['offset_s']:>7.0f}  skipped: {r['note']}")
            continue
        rec = "never" if r["recover_s"] is None else f"{r['recover_s']:.1f}"
        pids = ",".join(map(str, r["pids"]))[:13]
        lines.append(
            f"{r['kind']:<14}{r['offset_s']:>7.0f}{pids:>14}{rec:>11}{r['versions_before']:>10}"
            f"{r['versions_until_next_fault']:>11}{r['stored_until_next_fault']:>9}"
        )
    t = result["totals"]
    lines.append("")
    for key in (
        "work_items_emitted",
        "trajectories_produced",
        "trajectories_stored",
        "trajectories_by_status",
        "failed_explicitly",
        "lost",
        "duplicated",
        "versions_published",
    ):
        lines.append(f"{key:<24}{t[key]}")
    lines.append(f"{'completed':<24}{result['completed']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="240 s of RL (under 15 minutes on 2 cores)")
    parser.add_argument("--rl-seconds", type=float, default=None, help="RL wall time (240 quick, else 600)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault times and order")
    parser.add_argument("--no-s3", action="store_true", help="artifacts in a local directory (no stop-s3 fault)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="vllm adds the kill-engine fault")
    parser.add_argument(
        "--env", choices=("sim", "miniwob"), default="sim", help="miniwob (Chromium) adds the kill-backend fault"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "chaos", help="output folder")
    args = parser.parse_args()
    kinds = [f"kill-{s}" for s in SERVICES] + ["kill-nats", "freeze-rollout"]
    kinds += [] if args.no_s3 else ["stop-s3"]
    kinds += ["kill-engine"] if args.engine == "vllm" else []
    kinds += ["kill-backend"] if args.env == "miniwob" else []
    room = len(kinds) * (MIN_GAP_S + 5) / 0.7  # each fault's slot, with some jitter
    rl_s = args.rl_seconds or max(240.0 if args.quick else 600.0, room)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = out / "runs"
    faults = schedule(kinds, rl_s, args.seed)
    cfg = run_config(rl_s, not args.no_s3, args.engine, args.env, runs, out / "warm-start-cache")
    path = out / "chaos.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    started = time.monotonic()
    earlier = {p.parent for p in runs.glob("*/config.yaml")}
    with open(out / "chaos.log", "wb") as err:
        run = subprocess.Popen(
            [sys.executable, "-m", "dart.cli", "run", str(path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, "TERM": "dumb"},
        )
        injector = threading.Thread(target=inject, args=(run, runs, faults, earlier), daemon=True)
        injector.start()
        stdout, _ = run.communicate()
        injector.join(timeout=S3_OUTAGE_S + 5)
    lines = [ln for ln in stdout.decode().splitlines() if ln.strip().startswith("{")]
    if not lines:
        raise SystemExit(f"`dart run` exited with {run.returncode} and no summary; see {out / 'chaos.log'}")
    summary: dict[str, Any] = json.loads(lines[-1])
    result = account(Path(summary["run_dir"]), summary, faults)
    result["completed"] = run.returncode == 0 and summary.get("error") is None
    print(table(result), flush=True)
    t = result["totals"]
    skipped = [f.kind for f in faults if f.at_unix is None]
    ok = result["completed"] and t["lost"] == 0 and t["duplicated"] == 0 and not skipped
    print(
        json.dumps(
            {
                "machine": machine(),
                "seed": args.seed,
                "rl_seconds": rl_s,
                "s3": not args.no_s3,
                "engine": args.engine,
                "env": args.env,
                **result,
                "run_dir": summary["run_dir"],
                "error": summary.get("error"),
                "skipped_faults": skipped,
                "passed": ok,
                "total_seconds": round(time.monotonic() - started, 1),
            }
        )
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
