"""Soak: one long ``dart run``, sampled every minute; a figure that keeps growing fails it.

Runs ``python -m dart.cli run`` for ``--minutes`` of RL on the sim (``examples/smoke.yaml``) or on
MiniWoB++ in headless Chromium (``examples/miniwob.yaml``), with retention on and no sparse history kept
(the store must level off) and no held-out validation, and samples every ``--interval-s`` seconds:

- per service (``dart serve env|data|train|rollout``): resident memory of its process tree (the env
  service's browsers included), open file descriptors and threads of the service process;
- the bus: messages pending or unacknowledged on the work, trajectory and batch consumers;
- the store: bytes of the run's artifacts (trajectories, screenshots, weights) and of its index;
- the weight cache: bytes of the versions the rollout host downloaded (``<run_dir>/weights``, pruned to
  ``rollout.sync.keep_versions``).

For each figure it fits a line (least squares) over the second half of the samples, after the warm-up,
and fails when the slope passes the figure's bound (``BOUNDS``, per minute): growth that a single sample
could hide, or fake, does not decide it. A service that restarted fails it too. It prints the table; the
last line is one JSON object.

Usage::

    uv run python benchmarks/soak.py --minutes 30             # the sim
    uv run python benchmarks/soak.py --minutes 30 --env miniwob
    uv run python benchmarks/soak.py --minutes 3 --interval-s 10   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from chaos import children
from efficiency import machine

from dart.env.service.health import processes_rss_mib
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.topology import durable_name

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("env", "data", "train", "rollout")
CONSUMERS = ("work", "traj", "batch")
BOUNDS = {
    "rss_mib": 2.0,  # 60 MiB over 30 minutes, per service (its whole process tree)
    "fds": 0.5,
    "threads": 0.5,
    "bus_pending": 2.0,  # messages
    "store_mib": 2.0,  # with retention on, the store levels off
    "weight_cache_mib": 2.0,  # the rollout host keeps rollout.sync.keep_versions versions
}
"""Largest growth per minute over the second half of the run, per figure."""


def service_pids(run_pid: int) -> dict[str, int]:
    """The ``dart serve`` process of each service under ``dart run``."""
    found = {}
    for pid, argv in children(run_pid):
        for service in SERVICES:
            if "serve" in argv and service in argv:
                found[service] = pid
    return found


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                continue  # deleted by retention meanwhile
    return total


async def _bus_pending(run_dir: Path) -> int:
    """Pending plus unacked messages of the run's consumers, as the ``run`` role (what ``dart run`` uses)."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    bus_config = BusConfig(
        url=config["bus"]["url"],
        run=config["run"]["name"],
        user="run",
        password_file=run_dir / "secrets" / "nats-run.password",
        connect_timeout_s=5.0,
        max_reconnect_attempts=0,
    )
    async with await Bus.connect(bus_config) as bus:
        total = 0
        for kind in CONSUMERS:
            state = await bus.consumer_state(kind, durable_name(bus, kind))
            total += state.num_pending + state.num_ack_pending
        return total


def sample(run_pid: int, run_dir: Path, started: float) -> dict[str, Any]:
    """One sample of every figure."""
    row: dict[str, Any] = {"minute": round((time.monotonic() - started) / 60, 3)}
    for service, pid in service_pids(run_pid).items():
        try:
            row[service] = {
                "pid": pid,
                "rss_mib": round(processes_rss_mib([pid]), 1),
                "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "threads": _status(pid, "Threads"),
            }
        except OSError:
            continue  # it is restarting
    try:
        row["bus_pending"] = asyncio.run(_bus_pending(run_dir))
    except Exception as exc:  # reported, not fatal: the next sample tries again
        row["bus_error"] = f"{type(exc).__name__}: {exc}"
    index = sum(p.stat().st_size for p in run_dir.glob("data.sqlite3*"))
    row["store_mib"] = round((_tree_bytes(run_dir / "artifacts") + index) / 2**20, 2)
    row["weight_cache_mib"] = round(_tree_bytes(run_dir / "weights") / 2**20, 2)
    return row


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points; 0.0 for fewer than two distinct x."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in points) / sxx


def series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Every figure's (minute, value) points, named ``<service>.<figure>``, ``bus_pending``, ``store_mib`` or
    ``weight_cache_mib``."""
    out: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        for service in SERVICES:
            for figure in ("rss_mib", "fds", "threads"):
                if service in row:
                    out.setdefault(f"{service}.{figure}", []).append((row["minute"], row[service][figure]))
        for figure in ("bus_pending", "store_mib", "weight_cache_mib"):
            if figure in row:
                out.setdefault(figure, []).append((row["minute"], row[figure]))
    return out


def judge(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per figure: first and last values, the second half's slope per minute, its bound and the verdict."""
    verdicts = {}
    for name, points in series(rows).items():
        half = points[len(points) // 2 :]
        bound = BOUNDS[name.split(".")[-1]]
        growth = slope(half)
        verdicts[name] = {
            "first": points[0][1],
            "last": points[-1][1],
            "slope_per_min": round(growth, 3),
            "bound_per_min": bound,
            "ok": growth <= bound,
        }
    return verdicts


def run_config(env: str, minutes: float, runs: Path, cache: Path) -> dict[str, Any]:
    base = "miniwob.yaml" if env == "miniwob" else "smoke.yaml"
    cfg: dict[str, Any] = yaml.safe_load((REPO / "examples" / base).read_text())
    cfg["run"].update(
        {
            "name": f"soak-{env}",
            "runs_root": str(runs),
            "rl_duration_s": minutes * 60,
            "min_versions": 0,
            "max_rl_duration_s": minutes * 60 + 600,
            "artifacts": "local",
        }
    )
    cfg["validation"] = {"enabled": False}
    cfg.setdefault("warm_start", {})["cache_dir"] = str(cache)
    # Retention on, brisk and without the sparse history kept by design (every 50th version's trajectories,
    # every 10th version's weights), so the store must level off within the run.
    cfg.setdefault("data", {})["retention"] = {
        "keep_versions": 2,
        "keep_every": None,
        "interval_s": 30,
        "image_grace_s": 120,
    }
    cfg.setdefault("train", {})["retention"] = {"keep_every": None}
    cfg.setdefault("env", {})["screenshot_refresh_s"] = 60
    return cfg


def table(verdicts: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'figure':<22}{'first':>12}{'last':>12}{'slope/min':>12}{'bound/min':>12}  verdict"]
    for name, v in verdicts.items():
        verdict = "ok" if v["ok"] else "GROWS"
        lines.append(
            f"{name:<22}{v['first']:>12g}{v['last']:>12g}{v['slope_per_min']:>12g}{v['bound_per_min']:>12g}  {verdict}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of RL (default 30)")
    parser.add_argument("--env", choices=("sim", "miniwob"), default="sim", help="the env backend")
    parser.add_argument("--interval-s", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "soak", help="output folder")
    args = parser.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = out / "runs"
    cfg = run_config(args.env, args.minutes, runs, out / "warm-start-cache")
    path = out / f"soak-{args.env}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    earlier = {p.parent for p in runs.glob("*/config.yaml")}
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    with open(out / f"soak-{args.env}.log", "wb") as err:
        run = subprocess.Popen(
            [sys.executable, "-m", "dart.cli", "run", str(path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, "TERM": "dumb"},
        )

        def sampler() -> None:
            # Sampling starts when every service serves (after the warm start), at minute 0 of RL.
            while run.poll() is None and len(service_pids(run.pid)) < len(SERVICES):
                time.sleep(1.0)
            dirs = [p.parent for p in runs.glob("*/config.yaml") if p.parent not in earlier]
            if run.poll() is not None or not dirs:
                return
            rl_started = time.monotonic()
            while run.poll() is None:
                rows.append(sample(run.pid, dirs[0], rl_started))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                deadline = time.monotonic() + args.interval_s
                while run.poll() is None and time.monotonic() < deadline:
                    time.sleep(1.0)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        stdout, _ = run.communicate()
        thread.join(timeout=30)
    lines = [ln for ln in stdout.decode().splitlines() if ln.strip().startswith("{")]
    summary: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    # Samples taken while services stop at the end would read as shrinkage: only the RL phase counts.
    rows = [r for r in rows if r["minute"] <= args.minutes and all(s in r for s in SERVICES)]
    verdicts = judge(rows)
    print(table(verdicts), flush=True)
    restarts = summary.get("service_restarts", [])
    completed = run.returncode == 0 and summary.get("error") is None
    passed = completed and not restarts and len(rows) >= 4 and all(v["ok"] for v in verdicts.values())
    print(
        json.dumps(
            {
                "machine": machine(),
                "env": args.env,
                "minutes": args.minutes,
                "interval_s": args.interval_s,
                "samples": len(rows),
                "figures": verdicts,
                "service_restarts": restarts,
                "trajectories_stored": summary.get("trajectories_stored"),
                "trajectories_lost": summary.get("trajectories_lost"),
                "versions_published": summary.get("versions_published"),
                "run_dir": summary.get("run_dir"),
                "error": summary.get("error") if lines else f"dart run exited {run.returncode} without a summary",
                "passed": passed,
                "total_seconds": round(time.monotonic() - started, 1),
            }
        )
    )
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
