"""Decoupled vs coupled: resource utilization and throughput of the same workload, end to end.

Runs the real pipeline (``python -m dart.cli run CONFIG``: embedded nats-server, the four services
as processes) twice on one workload, derived from one base config:

- ``coupled``: the synchronous batch-RL baseline. dart-data emits rounds of B tasks x n rollouts,
  waits until every trajectory of the round arrived, publishes the round as one batch and emits
  the next round only once the trainer published the version trained on it
  (``data.emission.mode: coupled``); every engine updates at once (``rollout.sync.mode: coupled``);
  ``train.publish_every: 1``.
- ``decoupled``: the defaults (continuous emission with backpressure, rolling engine updates).

Same suite, model seed and warm-started weights (the second run reuses the first run's version-0
policy), env instances, engines, runners, batch size in groups (B) and RL wall time. Env step
latency is heavy-tailed to stand in for OSWorld desktops: lognormal with median 0.3 s and sigma 0.6
(a p90 around 0.65 s), and 5 % of operations stall 8x longer (a slow page load or app start); this
long tail is what a batch barrier waits on. Resets and evaluations draw from the same distribution.

Figures, over each run's RL window (from the first env reset, so the engines' start-up is left out):
- env utilization: busy reset/step/evaluate seconds / (instances x wall);
- engine utilization: busy generate seconds / (engines x wall);
- training throughput: trained step samples per minute (``samples`` of ``trainer.step`` events);
- trajectories per minute (messages on the trajectory stream).

Usage::

    uv run python benchmarks/efficiency.py --quick            # 2 x 150 s of RL, under 10 minutes
    uv run python benchmarks/efficiency.py --sweep 4,16,64     # the pair per env instance count

It prints a table per pair and, as the last line, one JSON object with every figure; the
utilization timelines go to ``<out>/efficiency.png`` (``efficiency-<N>.png`` in a sweep).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from dart.protocol.telemetry import read_jsonl, resource_utilization

REPO = Path(__file__).resolve().parent.parent
MODES = ("coupled", "decoupled")
STEP_LATENCY = {"kind": "lognormal", "median_s": 0.3, "sigma": 0.6, "tail_prob": 0.05, "tail_factor": 8.0}
"""OSWorld-like desktop latency (see the module docstring for the choice)."""
ROLLOUTS = 4
"""Rollouts per group, n (fixed: dynamic rollout counts are off so both modes see the same n)."""


def base_config(instances: int, rl_s: float, warm_steps: int, runs_root: Path) -> dict[str, Any]:
    """The workload both modes share."""
    tasks_per_round = max(1, instances // ROLLOUTS)  # a round gives every env instance one trajectory
    return {
        "run": {"name": "eff", "runs_root": str(runs_root), "rl_duration_s": rl_s, "torch_threads": 1},
        "suite": "builtin:smoke",
        "model": {"tiny_seed": 0},
        "warm_start": {"episodes_per_task": 2, "steps": warm_steps, "batch_size": 16, "lr": 0.003},
        "env": {"instances": instances, "sim": {"latency": {"step": STEP_LATENCY}}},
        "rollout": {
            "num_engines": 2,
            "runners": instances,
            "runner": {"max_images": 1, "max_new_tokens": 48},
        },
        "data": {
            "stats_interval_s": 2,
            "grouping": {"timeout_s": 120, "max_staleness": 4},
            "curation": {"dynamic_rollouts": False, "default_rollouts": ROLLOUTS, "min_rollouts": 2},
            "emission": {
                "max_outstanding": 2 * instances,
                "coupled_tasks_per_round": tasks_per_round,
                "work_timeout_s": 300,
            },
            # Batches of B groups in both modes (the coupled round's batch is its B groups).
            "batching": {"min_samples": 1_000_000, "max_groups": tasks_per_round},
        },
        "train": {"lr": 0.0001, "publish_every": 1, "micro_batch_size": 4},
    }


def mode_config(base: dict[str, Any], mode: str, policy: Path | None) -> dict[str, Any]:
    """The base config in one mode; ``policy`` reuses an already warm-started version 0."""
    cfg = json.loads(json.dumps(base))
    cfg["run"]["name"] = f"eff-{mode}"
    if mode == "coupled":
        cfg["data"]["emission"]["mode"] = "coupled"
        cfg["rollout"]["sync"] = {"mode": "coupled"}
        cfg["train"]["publish_every"] = 1
    if policy is not None:
        cfg["model"] = {"path": str(policy)}
        cfg["warm_start"] = {"enabled": False}
    return cfg


def run_mode(cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run ``dart run`` on ``cfg``; returns its summary."""
    name = cfg["run"]["name"]
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = work / f"{name}.log"
    print(f"[efficiency] running {name} (log: {log})", file=sys.stderr, flush=True)
    env = {**os.environ, "TERM": "dumb"}
    with open(log, "wb") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "dart.cli", "run", str(path)], cwd=REPO, stdout=subprocess.PIPE, stderr=err, env=env
        )
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.strip().startswith("{")]
    if not lines:
        raise RuntimeError(f"`dart run {path}` failed with exit code {proc.returncode}; see {log}")
    if proc.returncode != 0:  # the summary says why (``error``); its figures are still reported
        print(f"[efficiency] {name} exited with {proc.returncode}; see {log}", file=sys.stderr, flush=True)
    summary: dict[str, Any] = json.loads(lines[-1])
    return summary


def rl_window(summary: dict[str, Any]) -> tuple[int, int]:
    """The measured window, Unix ns: from the first env reset to the end of the RL phase.

    ``dart run`` starts its RL clock when it spawns the services; the rollout service then spends
    10-30 s on 2 cores loading its engines, the same in both modes. That start-up is left out.
    """
    start, end = int(summary["rl_start_unix_ns"]), int(summary["rl_end_unix_ns"])
    resets = [
        int(r["start_unix_ns"])
        for r in read_jsonl(Path(summary["run_dir"]) / "telemetry" / "env.jsonl", types={"busy"})
        if r["activity"] == "reset" and int(r["start_unix_ns"]) >= start
    ]
    return (min(resets), end) if resets and min(resets) < end else (start, end)


def figures(summary: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The compared figures of one run, from its summary and telemetry."""
    run_dir = Path(summary["run_dir"])
    tel = run_dir / "telemetry"
    start, end = rl_window(summary)
    wall = (end - start) / 1e9
    counts = {"env": cfg["env"]["instances"], "engine": cfg["rollout"]["num_engines"], "trainer": 1}
    util = {}
    for kind, n in counts.items():
        per = resource_utilization(tel, start_ns=start, end_ns=end, resource_kind=kind)
        util[kind] = sum(u.busy_s for u in per.values()) / (n * wall)
    steps = [
        r["attributes"]
        for r in read_jsonl(tel / "train.jsonl", types={"event"})
        if r["name"] == "trainer.step" and start <= int(r["ts_unix_ns"]) <= end
    ]
    samples = sum(int(a["samples"]) for a in steps)
    return {
        "run_dir": str(run_dir),
        "rl_seconds": round(wall, 1),
        "env_utilization": round(util["env"], 4),
        "engine_utilization": round(util["engine"], 4),
        "trainer_utilization": round(util["trainer"], 4),
        "train_samples_per_minute": round(samples / wall * 60, 2),
        "train_steps": len(steps),
        "trajectories_per_minute": round(summary["trajectories_produced"] / wall * 60, 2),
        "trajectories": summary["trajectories_produced"],
        "versions_published": summary["versions_published"],
        "success_rate_overall": summary["success_rate_overall"],
        "error": summary.get("error"),
    }


def timeline(summary: dict[str, Any], cfg: dict[str, Any], bin_s: float = 5.0) -> dict[str, list[float]]:
    """Utilization per ``bin_s`` bin and resource kind over the RL window."""
    start, end = rl_window(summary)
    width = int(bin_s * 1e9)
    bins = max(1, (end - start) // width)
    counts = {"env": cfg["env"]["instances"], "engine": cfg["rollout"]["num_engines"], "trainer": 1}
    busy = {kind: [0.0] * bins for kind in counts}
    for r in read_jsonl(Path(summary["run_dir"]) / "telemetry", types={"busy"}):
        kind = r["resource_kind"]
        if kind not in busy:
            continue
        lo, hi = max(int(r["start_unix_ns"]), start), min(int(r["end_unix_ns"]), start + bins * width)
        while lo < hi:
            b = (lo - start) // width
            edge = min(hi, start + (b + 1) * width)
            busy[kind][b] += edge - lo
            lo = edge
    return {kind: [min(1.0, v / (counts[kind] * width)) for v in vals] for kind, vals in busy.items()}


def plot(lines: dict[str, dict[str, list[float]]], path: Path, title: str, bin_s: float = 5.0) -> None:
    """Both modes' utilization timelines, one panel per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(lines), 1, figsize=(10, 3.2 * len(lines)), sharex=True, sharey=True)
    for ax, (mode, series) in zip(axes, lines.items(), strict=True):
        for kind, vals in series.items():
            ax.plot([i * bin_s for i in range(len(vals))], vals, label=kind)
        ax.set_title(f"{mode}")
        ax.set_ylabel("utilization")
        ax.set_ylim(0, 1.05)
        ax.legend(loc="lower right")
    axes[-1].set_xlabel(f"seconds of RL ({bin_s:.0f} s bins)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RATIO_KEYS = ("env_utilization", "engine_utilization", "train_samples_per_minute", "trajectories_per_minute")


def compare(instances: int, rl_s: float, warm_steps: int, out: Path, png: Path) -> dict[str, Any]:
    """Run the pair for one env instance count; returns both modes' figures and the ratios."""
    work = out / f"n{instances}"
    work.mkdir(parents=True, exist_ok=True)
    base = base_config(instances, rl_s, warm_steps, work / "runs")
    result: dict[str, Any] = {"instances": instances}
    lines: dict[str, dict[str, list[float]]] = {}
    policy: Path | None = None
    for mode in MODES:
        cfg = mode_config(base, mode, policy)
        summary = run_mode(cfg, work)
        if policy is None:
            policy = Path(summary["run_dir"]) / "model" / "sft"
        result[mode] = figures(summary, cfg)
        lines[mode] = timeline(summary, cfg)
    result["ratio"] = {
        k: round(result["decoupled"][k] / result["coupled"][k], 3) if result["coupled"][k] else None for k in RATIO_KEYS
    }
    plot(lines, png, f"{instances} env instances, {base['rollout']['num_engines']} engines, {rl_s:.0f} s of RL")
    result["plot"] = str(png)
    return result


def table(result: dict[str, Any]) -> str:
    """The pair as a text table."""
    rows = [f"env instances: {result['instances']}", f"{'figure':<28}{'coupled':>12}{'decoupled':>12}{'ratio':>9}"]
    for k in (*RATIO_KEYS, "trainer_utilization", "train_steps", "versions_published"):
        c, d = result["coupled"][k], result["decoupled"][k]
        ratio = result["ratio"].get(k)
        rows.append(f"{k:<28}{c:>12}{d:>12}{'' if ratio is None else ratio:>9}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="150 s of RL per mode, 80 warm-start steps")
    parser.add_argument("--sweep", type=str, default=None, help="env instance counts, e.g. 4,16,64")
    parser.add_argument("--instances", type=int, default=8, help="env instances (and runners) without --sweep")
    parser.add_argument("--rl-seconds", type=float, default=None, help="RL wall time per mode (default 120/300)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out", help="output folder")
    args = parser.parse_args()
    rl_s = args.rl_seconds or (150.0 if args.quick else 300.0)
    warm_steps = 80 if args.quick else 120
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    counts = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.instances]
    started = time.monotonic()
    results = []
    for n in counts:
        png = out / ("efficiency.png" if len(counts) == 1 else f"efficiency-{n}.png")
        result = compare(n, rl_s, warm_steps, out, png)
        results.append(result)
        print(table(result), flush=True)
        print(flush=True)
    if len(results) > 1:
        print("ratios decoupled/coupled by env instance count:")
        print(f"{'instances':>10}" + "".join(f"{k:>26}" for k in RATIO_KEYS))
        for r in results:
            print(f"{r['instances']:>10}" + "".join(f"{str(r['ratio'][k]):>26}" for k in RATIO_KEYS))
    print(
        json.dumps(
            {
                "machine": {
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                },
                "step_latency": STEP_LATENCY,
                "rl_seconds_per_mode": rl_s,
                "warm_start_steps": warm_steps,
                "results": results,
                "total_seconds": round(time.monotonic() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
