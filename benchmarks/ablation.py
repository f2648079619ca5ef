"""The paper's cumulative ablation: each adaptive-curation feature added in turn, measured end to end.

DART-GUI (arXiv 2509.23866) reports a cumulative table: baseline GRPO, then + dynamic rollout count,
+ dynamic trajectory length, + high-entropy step selection, + truncated importance sampling,
+ experience pool. This script runs that table on our pipeline (``python -m dart.cli run``: embedded
nats-server, the four services as processes, decoupled mode), each row for the same RL wall time
and on the same seeds, all rows from ONE warm-started version-0 policy:

- ``grpo``: n = ``ROLLOUTS`` rollouts per task, the task's full step budget, every step trained,
  no correction of the rollout/trainer policy mismatch (``train.loss.tis_cap: null``), no pool;
- ``+dyn_rollouts``: ``data.curation.dynamic_rollouts`` (2-``ROLLOUTS`` rollouts by success rate);
- ``+dyn_length``: ``data.curation.dynamic_max_steps`` (step budget from successful lengths);
- ``+entropy``: ``train.entropy_top_fraction`` (train on the steps with the highest mean entropy);
- ``+tis``: ``train.loss.tis_cap: 2.0`` (truncated importance sampling);
- ``+pool``: ``data.curation.experience_pool`` (successes of hard tasks fill all-failure groups);
- ``+branching``: ``data.curation.branching`` (each rollout forked at its least sure step, twice; steps from
  there credited against the siblings), beyond the paper.

``--env-steps N`` gives every run the same env budget (``data.emission.max_env_steps``: no more work once the
stored trajectories took N env steps, forks' replayed actions included) within the same RL wall time, so rows
that spend env steps differently (branching) are compared on equal env work. ``--rows`` picks rows (the
cumulative configs are still built from the first row down).

Per row and seed: greedy success of the final version on the training split (``validation.train_split``)
and held-out greedy success (``validation``, on a split whose
layout seeds never appear in warm start or RL; ``at_start: false`` because version 0 is the same
policy for every run and is evaluated once, up front, with ``dart eval``), and the throughput
figures of ``benchmarks/efficiency.py`` (trained samples and trajectories per minute in the RL
window, versions published), and per success of the training rollouts (trainable trajectories that succeeded,
branches included): env steps and trainer samples. Per row: mean, sample standard deviation and 95 % interval
(Student's t) over seeds, and each feature's effect (the row minus the row above).

Suites: ``--suite sim`` (default) trains on ``builtin:smoke`` (8 tasks, the smoke run's settings) and
validates on ``builtin:heldout``; ``--suite sim-train`` trains on the quickstart's ``builtin:train`` (64
tasks; its 700-step warm start solves 21 of them greedily, measured 2026-11-26);
``--suite miniwob`` trains on ``builtin:miniwob/train`` and validates on ``builtin:miniwob/heldout``
(MiniWoB++ in headless Chromium, other seeds of the same task types).

Usage::

    uv run python benchmarks/ablation.py --quick                 # 6 rows x 3 seeds, 40 s of RL each
    uv run python benchmarks/ablation.py --seeds 0,1,2,3,4 --rl-seconds 300
    uv run python benchmarks/ablation.py --quick --suite miniwob

It prints the table and, as the last line, one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from efficiency import figures, machine, run_mode

from dart.runtime.telemetry import read_jsonl

REPO = Path(__file__).resolve().parent.parent
ROLLOUTS = 4
"""Rollouts per group of the baseline (and the most a dynamic count gives)."""

ROWS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "grpo",
        {
            "data": {
                "curation": {
                    "dynamic_rollouts": False,
                    "default_rollouts": ROLLOUTS,
                    "dynamic_max_steps": False,
                    "experience_pool": False,
                    "branching": {"enabled": False},  # the examples may turn it on (miniwob.yaml does)
                }
            },
            "train": {"entropy_top_fraction": 1.0, "loss": {"tis_cap": None}},
        },
    ),
    ("+dyn_rollouts", {"data": {"curation": {"dynamic_rollouts": True}}}),
    ("+dyn_length", {"data": {"curation": {"dynamic_max_steps": True}}}),
    ("+entropy", {"train": {"entropy_top_fraction": 0.5}}),
    ("+tis", {"train": {"loss": {"tis_cap": 2.0}}}),
    ("+pool", {"data": {"curation": {"experience_pool": True}}}),
    ("+branching", {"data": {"curation": {"branching": {"enabled": True, "max_points": 1, "continuations": 2}}}}),
)
"""The cumulative rows: each applies its overrides on top of the row above."""

SUITES: dict[str, dict[str, Any]] = {
    "sim": {"suite": "builtin:smoke", "heldout": "builtin:heldout", "example": "smoke.yaml"},
    "sim-train": {"suite": "builtin:train", "heldout": "builtin:heldout", "example": "quickstart.yaml"},
    "miniwob": {
        "suite": "builtin:miniwob/train",
        "heldout": "builtin:miniwob/heldout",
        "example": "miniwob.yaml",
        # The example's 40 steps leave the policy solving none of the 24 training tasks (measured: 0 %
        # in every quarter, one trainer step in 40 s of RL); 300 steps fit their 37 oracle steps.
        "overrides": {"warm_start": {"steps": 300, "max_seconds": 900}},
    },
}
"""Per ``--suite``: the training split, the held-out split, the example config the runs start from, and
what the ablation changes in that example besides RL time and splits (``overrides``)."""


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` applied recursively (mappings merge, everything else replaces)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def base_config(suite: str, rl_s: float, runs_root: Path, cache: Path) -> dict[str, Any]:
    """The example config of ``suite`` set up for the ablation (RL time, splits, final-only validation)."""
    spec = SUITES[suite]
    cfg: dict[str, Any] = yaml.safe_load((REPO / "examples" / spec["example"]).read_text())
    cfg.pop("extends", None)
    cfg.pop("telemetry", None)  # no TensorBoard files: the figures come from the JSONL telemetry
    cfg = merged(cfg, spec.get("overrides", {}))
    return merged(
        cfg,
        {
            "run": {"name": "abl", "runs_root": str(runs_root), "rl_duration_s": rl_s, "min_versions": 0},
            "suite": spec["suite"],
            "validation": {
                "enabled": True,
                "suite": spec["heldout"],
                "every_versions": 1_000_000,  # the final version only
                "at_start": False,
                "instances": 2,
                "train_split": True,
            },
            "warm_start": {"cache_dir": str(cache)},
            "data": {"curation": {"max_rollouts": ROLLOUTS, "min_rollouts": 2}},
        },
    )


def row_configs(base: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each row's full config, cumulative."""
    out, cfg = [], base
    for name, over in ROWS:
        cfg = merged(cfg, over)
        out.append((name, cfg))
    return out


def warm_start(base: dict[str, Any], work: Path) -> Path:
    """Warm-start version 0 once (a run with the shortest RL phase); returns the checkpoint."""
    cfg = merged(base, {"run": {"name": "abl-warm", "rl_duration_s": 1}, "validation": {"enabled": False}})
    summary = run_mode(cfg, work)
    policy = Path(summary["run_dir"]) / "model" / "sft"
    if not (policy / "config.json").is_file():
        raise RuntimeError(f"the warm start left no checkpoint at {policy}: {summary.get('error')}")
    return policy


def evaluate_v0(base: dict[str, Any], policy: Path, work: Path) -> dict[str, Any]:
    """Held-out greedy success of version 0, with ``dart eval`` on the same settings as validation."""
    path = work / "abl-eval.yaml"
    path.write_text(yaml.safe_dump(merged(base, {"run": {"name": "abl-eval"}}), sort_keys=False))
    v = base["validation"]
    cmd = [sys.executable, "-m", "dart.cli", "eval", str(policy), "--config", str(path), "--suite", v["suite"]]
    cmd += ["--instances", str(v["instances"])]
    print(f"[ablation] evaluating version 0 on {v['suite']}", file=sys.stderr, flush=True)
    with open(work / "abl-eval.log", "wb") as err:
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, env={**os.environ, "TERM": "dumb"})
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.strip().startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"`dart eval` failed with exit code {proc.returncode}; see {work / 'abl-eval.log'}")
    report: dict[str, Any] = json.loads(lines[-1])
    return {k: report.get(k) for k in ("success", "ci95", "n")}


def run_row(cfg: dict[str, Any], policy: Path, seed: int, work: Path, label: str) -> dict[str, Any]:
    """One row on one seed: its held-out success and throughput figures."""
    cfg = merged(
        cfg,
        {
            "run": {"name": f"abl-{label}-s{seed}", "seed": seed},
            "model": {"path": str(policy)},
            "warm_start": {"enabled": False},
        },
    )
    return row_result(run_mode(cfg, work), cfg, seed)


def spent(run_dir: Path) -> dict[str, Any]:
    """What a run spent and got: env steps (the data manager's count), trainer samples, and the training
    rollouts that succeeded (trainable, branches included), from its telemetry and index."""
    tel = run_dir / "telemetry"
    stats = [e["attributes"] for e in read_jsonl(tel / "data.jsonl", types={"event"}) if e["name"] == "data.stats"]
    samples = sum(
        int(e["attributes"]["samples"])
        for e in read_jsonl(tel / "train.jsonl", types={"event"})
        if e["name"] == "trainer.step"
    )
    with sqlite3.connect(f"file:{run_dir / 'data.sqlite3'}?mode=ro", uri=True) as db:
        successes, branches = db.execute(
            "SELECT SUM(success), SUM(parent_trajectory_id IS NOT NULL) FROM trajectories "
            "WHERE status IN ('ok', 'truncated')"
        ).fetchone()
    env_steps = int(stats[-1]["env_steps"]) if stats else None
    successes = int(successes or 0)
    return {
        "env_steps": env_steps,
        "train_samples": samples,
        "successes": successes,
        "branch_trajectories": int(branches or 0),
        "env_steps_per_success": round(env_steps / successes, 2) if env_steps and successes else None,
        "samples_per_success": round(samples / successes, 2) if successes else None,
    }


def row_result(summary: dict[str, Any], cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """The figures of one finished run (its ``dart run`` summary and the config it ran)."""
    fig = figures(summary, cfg)
    final = (summary.get("heldout") or [{}])[-1]
    train = (summary.get("train_greedy") or [{}])[-1]
    return {
        "seed": seed,
        "heldout_success": summary.get("heldout_success_final"),
        "heldout_ci95": final.get("ci95"),
        "heldout_n": final.get("n"),
        "heldout_version": final.get("version"),
        "train_split_success": train.get("success"),
        "train_split_ci95": train.get("ci95"),
        "train_split_n": train.get("n"),
        **spent(Path(fig["run_dir"])),
        "train_success_first_quarter": summary.get("success_rate_first_quarter"),
        "train_success_last_quarter": summary.get("success_rate_last_quarter"),
        "train_samples_per_minute": fig["train_samples_per_minute"],
        "trajectories_per_minute": fig["trajectories_per_minute"],
        "train_steps": fig["train_steps"],
        "versions_published": fig["versions_published"],
        "trajectories_lost": summary.get("trajectories_lost"),
        "run_dir": fig["run_dir"],
        "error": summary.get("error"),
    }


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Student's t quantile 0.975 by degrees of freedom (1.96 beyond)."""


def spread(values: list[float | None]) -> dict[str, float | None]:
    """Mean, sample standard deviation and 95 % interval half-width (Student's t) of the values that exist."""
    xs = [float(v) for v in values if v is not None]
    sd = statistics.stdev(xs) if len(xs) > 1 else None
    half = None if sd is None else T975.get(len(xs) - 1, 1.96) * sd / math.sqrt(len(xs))
    return {
        "mean": round(statistics.fmean(xs), 4) if xs else None,
        "sd": round(sd, 4) if sd is not None else None,
        "ci95_half": round(half, 4) if half is not None else None,
        "n": len(xs),
    }


def summarize(rows: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per row: held-out success and throughput over seeds, and the effect of the row's feature."""
    out: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for name, runs in rows.items():
        entry: dict[str, Any] = {"row": name, "runs": runs}
        for key in (
            "heldout_success",
            "train_split_success",
            "train_success_first_quarter",
            "train_success_last_quarter",
            "train_samples_per_minute",
            "trajectories_per_minute",
            "versions_published",
            "env_steps",
            "env_steps_per_success",
            "samples_per_success",
        ):
            entry[key] = spread([r.get(key) for r in runs])
        if previous is not None:
            entry["effect"] = {
                key: None
                if entry[key]["mean"] is None or previous[key]["mean"] is None
                else round(entry[key]["mean"] - previous[key]["mean"], 4)
                for key in (
                    "heldout_success",
                    "train_split_success",
                    "train_success_last_quarter",
                    "train_samples_per_minute",
                    "trajectories_per_minute",
                    "env_steps_per_success",
                    "samples_per_success",
                )
            }
        out.append(entry)
        previous = entry
    return out


def table(summary: list[dict[str, Any]], v0: dict[str, Any]) -> str:
    """The ablation as a text table (mean ± sd over seeds; effect = this row minus the row above)."""

    def cell(s: dict[str, float | None], pct: bool = False, spread: str = "sd") -> str:
        """``mean ± spread`` (the sample standard deviation, or ``ci95_half``), in percent with ``pct``."""
        if s["mean"] is None:
            return "-"
        scale = 100.0 if pct else 1.0
        plus = "" if s[spread] is None else f" ± {s[spread] * scale:.1f}"
        return f"{s['mean'] * scale:.1f}{plus}"

    v0_success = "-" if v0["success"] is None else f"{100 * v0['success']:.1f}"
    lines = [
        f"held-out success of version 0 (shared by every row): {v0_success} % (n={v0['n']})",
        "mean ± sd over seeds; effect: this row minus the row above; train %: success of training rollouts"
        " in the first and last quarter",
        f"{'row':<15}{'held-out %':>14}{'effect':>8}{'train % first':>15}{'train % last':>14}{'effect':>8}"
        f"{'samples/min':>15}{'effect':>8}{'traj/min':>13}{'versions':>12}",
    ]

    def effect(value: float | None, pct: bool) -> str:
        return "" if value is None else (f"{100 * value:+.1f}" if pct else f"{value:+.0f}")

    for e in summary:
        eff = e.get("effect", {})
        lines.append(
            f"{e['row']:<15}{cell(e['heldout_success'], True):>14}{effect(eff.get('heldout_success'), True):>8}"
            f"{cell(e['train_success_first_quarter'], True):>15}{cell(e['train_success_last_quarter'], True):>14}"
            f"{effect(eff.get('train_success_last_quarter'), True):>8}"
            f"{cell(e['train_samples_per_minute']):>15}{effect(eff.get('train_samples_per_minute'), False):>8}"
            f"{cell(e['trajectories_per_minute']):>13}{cell(e['versions_published']):>12}"
        )

    def interval(s: dict[str, float | None], pct: bool = False) -> str:
        return cell(s, pct, spread="ci95_half")

    lines += [
        "",
        "final version, greedy (train split, held-out) and what the RL phase spent per success of its training"
        " rollouts; mean ± 95 % interval over seeds (Student's t)",
        f"{'row':<15}{'train split %':>16}{'held-out %':>16}{'env steps':>16}{'env steps/success':>20}"
        f"{'samples/success':>18}",
    ]
    for e in summary:
        lines.append(
            f"{e['row']:<15}{interval(e['train_split_success'], True):>16}{interval(e['heldout_success'], True):>16}"
            f"{interval(e['env_steps']):>16}{interval(e['env_steps_per_success']):>20}"
            f"{interval(e['samples_per_success']):>18}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="40 s of RL per run, seeds 0,1,2 (about 30 minutes)")
    parser.add_argument("--suite", choices=tuple(SUITES), default="sim", help="sim (default) or miniwob")
    parser.add_argument("--seeds", type=str, default=None, help="comma-separated run seeds (default 0,1,2)")
    parser.add_argument("--rl-seconds", type=float, default=None, help="RL wall time per run (40 quick, else 240)")
    parser.add_argument(
        "--env-steps", type=int, default=None, help="the env budget of every run (data.emission.max_env_steps)"
    )
    parser.add_argument(
        "--rows", type=str, default=None, help="comma-separated rows to run (default all): e.g. +pool,+branching"
    )
    parser.add_argument(
        "--policy",
        type=Path,
        default=None,
        help="a warm-started version-0 checkpoint to reuse (<run_dir>/model/sft); skips the warm start",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "ablation", help="output folder")
    parser.add_argument(
        "--resume", action="store_true", help="keep the finished runs of <out>/results.jsonl and run the rest"
    )
    parser.add_argument(
        "--render", type=Path, default=None, help="print the table of a finished run's JSON line (a file) and exit"
    )
    args = parser.parse_args()
    if args.render is not None:
        done = json.loads(args.render.read_text().strip().splitlines()[-1])
        print(table(summarize({row["row"]: row["runs"] for row in done["rows"]}), done["heldout_v0"]))
        return
    rl_s = args.rl_seconds or (40.0 if args.quick else 240.0)
    seeds = [int(s) for s in (args.seeds or "0,1,2").split(",")]
    out: Path = args.out.resolve() / args.suite
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    base = base_config(args.suite, rl_s, out / "runs", out.parent / "warm-start-cache")
    if args.env_steps is not None:
        base = merged(base, {"data": {"emission": {"max_env_steps": args.env_steps}}})
    names = [name for name, _ in ROWS]
    chosen = names if args.rows is None else [r.strip() for r in args.rows.split(",")]
    if unknown := sorted(set(chosen) - set(names)):
        parser.error(f"unknown rows {unknown}; the rows are {names}")
    policy = args.policy.resolve() if args.policy else warm_start(base, out)
    v0 = evaluate_v0(base, policy, out)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names if name in chosen}
    done = out / "results.jsonl"  # one line per finished run: --resume skips those
    if args.resume and done.is_file():
        for line in done.read_text().splitlines():
            entry = json.loads(line)
            if entry["seed"] in seeds and entry["row"] in rows:
                rows[entry["row"]].append(entry["result"])
    else:
        done.unlink(missing_ok=True)
    for seed in seeds:  # seed-major: an interrupted benchmark still has every row on its first seeds
        for name, cfg in row_configs(base):
            if name not in rows or any(r["seed"] == seed for r in rows[name]):
                continue
            label = name.lstrip("+").replace("_", "-")
            result = run_row(cfg, policy, seed, out, label)
            rows[name].append(result)
            with done.open("a") as f:
                f.write(json.dumps({"row": name, "seed": seed, "result": result}) + "\n")
            print(f"[ablation] {name} seed {seed}: {result['heldout_success']}", file=sys.stderr, flush=True)
    summary = summarize(rows)
    print(table(summary, v0), flush=True)
    print(
        json.dumps(
            {
                "machine": machine(),
                "suite": args.suite,
                "rl_seconds_per_run": rl_s,
                "env_steps_per_run": args.env_steps,
                "seeds": seeds,
                "policy": str(policy),
                "heldout_v0": v0,
                "rows": summary,
                "total_seconds": round(time.monotonic() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
