"""The end-of-run summary: figures computed from the run's own records, never assumed.

- versions published: the newest ModelVersion in the state bucket;
- trajectories produced: distinct trajectory ids on the trajectory stream; duplicated: messages that
  repeat an id stored before them (a replay, which dart-data's index stores once); stored: rows in
  dart-data's index; rejected: messages dart-data refused at ingestion (its ``rejected_trajectories``, by
  reason); lost: produced minus stored minus rejected;
- steps: the mean and the largest number of steps of the stored rollouts (ok or truncated; experience-pool
  replays and branches included, as they are what the trainer reads);
- success rates: trainable RL trajectories (ok/truncated, experience-pool replays excluded) in
  order of finish, first and last quarter;
- utilization: busy records of each resource kind over the RL window (telemetry JSONL);
- idle breakdown: where each resource kind's time went over the RL window
  (:mod:`dart.cli.analytics.idle`), resource counts from the run's ``config.yaml``;
- GPU: mean NVML utilization of the rollout and train services' samples, or ``"no GPU"``;
- tasks: how many the data manager emitted work for, and how many of the suite's it left out because the
  env pool does not run them, by what the pool lacks (its latest ``data.stats`` event);
- staleness: the largest policy lag of any sample the trainer trained on (``trainer.step``
  events; experience-pool replays apart), the samples it dropped as too stale
  (``trainer.stale_dropped``) and the pauses of work emission on the trainer's backlog
  (``data.emission_throttled``);
- weight cache: each rollout host's download cache of weight versions (versions, bytes) after its last fetch
  (``rollout.weight_cache`` events).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import yaml

from dart.cli.analytics import idle_breakdown_from_dir, resource_utilization
from dart.runtime.telemetry import gpu_summary, read_jsonl


def trajectory_outcomes(db_path: Path) -> list[tuple[float, bool, int]]:
    """(finished_at, success, max_policy_version) of trainable, non-pooled trajectories, by finish time."""
    if not db_path.is_file():
        return []
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT finished_at, success, max_policy_version FROM trajectories "
            "WHERE status IN ('ok', 'truncated') AND NOT pooled ORDER BY finished_at"
        ).fetchall()
    finally:
        con.close()
    return [(float(a), bool(b), int(c)) for a, b, c in rows]


def step_figures(db_path: Path) -> dict[str, float | int | None]:
    """Mean and largest steps of the stored rollouts that ran to an end (status ok or truncated)."""
    mean: float | None = None
    largest: int | None = None
    if db_path.is_file():
        con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        try:
            row = con.execute(
                "SELECT AVG(num_steps), MAX(num_steps) FROM trajectories WHERE status IN ('ok', 'truncated')"
            ).fetchone()
        finally:
            con.close()
        if row[0] is not None:
            mean, largest = round(float(row[0]), 2), int(row[1])
    return {"mean_steps_per_trajectory": mean, "max_steps_per_trajectory": largest}


def stored_count(db_path: Path) -> int:
    """Trajectories in the index (all statuses)."""
    if not db_path.is_file():
        return 0
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return int(con.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0])
    finally:
        con.close()


def rejected_counts(db_path: Path) -> dict[str, int]:
    """Messages dart-data refused at ingestion, by reason (none before the index records them)."""
    if not db_path.is_file():
        return {}
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        if not con.execute("SELECT 1 FROM sqlite_master WHERE name = 'rejected_trajectories'").fetchone():
            return {}
        rows = con.execute("SELECT reason, COUNT(*) FROM rejected_trajectories GROUP BY reason ORDER BY reason")
        return {str(reason): int(n) for reason, n in rows}
    finally:
        con.close()


def quarter_success(outcomes: list[tuple[float, bool, int]]) -> tuple[float | None, float | None]:
    """Success rate of the first and the last quarter of the outcomes (None when too few)."""
    n = len(outcomes) // 4
    if n == 0:
        return None, None
    first = sum(s for _, s, _ in outcomes[:n]) / n
    last = sum(s for _, s, _ in outcomes[-n:]) / n
    return first, last


def utilization_by_kind(telemetry_dir: Path, start_ns: int, end_ns: int) -> dict[str, float]:
    """Mean utilization per resource kind over a window."""
    per = resource_utilization(telemetry_dir, start_ns=start_ns, end_ns=end_ns)
    out: dict[str, list[float]] = {}
    for (kind, _), u in per.items():
        out.setdefault(kind, []).append(u.utilization)
    return {kind: sum(v) / len(v) for kind, v in out.items()}


def resource_counts(run_dir: Path) -> dict[str, int]:
    """Env instances, engines, runners and trainers of the run, from its ``config.yaml``."""
    path = run_dir / "config.yaml"
    cfg = yaml.safe_load(path.read_text()) if path.is_file() else {}
    cfg = cfg if isinstance(cfg, dict) else {}
    env = cfg.get("env") or {}
    rollout = cfg.get("rollout") or {}
    return {
        "env": int(env.get("instances", 0)),
        "engine": int(rollout.get("num_engines", 1)),
        "runner": int(rollout.get("runners", 0)),
        "trainer": 1,
    }


def idle_and_gpu(run_dir: Path, start_ns: int, end_ns: int) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The idle breakdown (None for an empty window) and the GPU figures of a window."""
    tel = run_dir / "telemetry"
    idle = None
    if end_ns > start_ns and tel.is_dir():
        idle = idle_breakdown_from_dir(tel, start_ns, end_ns, resource_counts(run_dir)).to_dict()
    gpu: dict[str, Any] = {}
    for service in ("rollout", "train"):
        g = gpu_summary(tel, start_ns=start_ns, end_ns=end_ns, service=service) if tel.is_dir() else None
        if g is None or g.mean_util_pct is None:
            gpu[service] = "no GPU"
        else:
            gpu[service] = {
                "mean_util_pct": round(g.mean_util_pct, 1),
                "max_mem_used_bytes": g.max_mem_used_bytes,
                "samples": g.samples,
            }
    return idle, gpu


def staleness_figures(telemetry_dir: Path) -> dict[str, Any]:
    """What the staleness bounds let through and held back, from the services' telemetry events.

    ``max_trained_policy_lag`` is the largest version lag of a fresh sample that was trained on (None
    before the first step); experience-pool replays are old on purpose and get
    ``max_trained_pool_policy_lag`` (None when none was trained). ``stale_samples_dropped`` and
    ``stale_batches_dropped`` (left with no sample) count the trainer's drops; ``emission_throttles``
    the pauses of work emission while batches queued for the trainer.
    """
    lags: list[int] = []
    pool_lags: list[int] = []
    dropped = dropped_batches = throttles = 0
    events = read_jsonl(telemetry_dir, types={"event"}) if telemetry_dir.is_dir() else iter(())
    for record in events:
        name, attrs = record.get("name"), record.get("attributes") or {}
        if name == "trainer.step":
            lags.append(int(attrs.get("max_policy_lag", 0)))
            if attrs.get("pool_samples"):
                pool_lags.append(int(attrs.get("pool_max_policy_lag", 0)))
        elif name == "trainer.stale_dropped":
            dropped += int(attrs.get("samples", 0))
            dropped_batches += attrs.get("kept") == 0
        elif name == "data.emission_throttled":
            throttles += 1
    return {
        "max_trained_policy_lag": max(lags, default=None),
        "max_trained_pool_policy_lag": max(pool_lags, default=None),
        "stale_samples_dropped": dropped,
        "stale_batches_dropped": dropped_batches,
        "emission_throttles": throttles,
    }


def published_figures(telemetry_dir: Path) -> dict[str, Any]:
    """What the published versions were, from the trainer's ``trainer.published`` events: ``version_kind``
    (``weights``, or ``lora adapter rank R`` for a LoRA run) and ``version_bytes`` (of the last; None
    before any)."""
    last: dict[str, Any] = {}
    events = read_jsonl(telemetry_dir, types={"event"}) if telemetry_dir.is_dir() else iter(())
    for record in events:
        if record.get("name") == "trainer.published":
            last = record.get("attributes") or {}
    kind = last.get("kind")
    if kind == "lora adapter":
        kind = f"lora adapter rank {last.get('adapter_rank')}"
    return {"version_kind": kind, "version_bytes": last.get("bytes")}


def retention_figures(telemetry_dir: Path) -> dict[str, int]:
    """What the data manager's retention deleted during the run (its ``data.retention`` events):
    trajectories whose objects went, objects and bytes deleted, shared screenshots among them."""
    totals = {"trajectories": 0, "objects": 0, "bytes": 0, "screenshots": 0}
    events = read_jsonl(telemetry_dir, types={"event"}) if telemetry_dir.is_dir() else iter(())
    for record in events:
        if record.get("name") == "data.retention":
            attrs = record.get("attributes") or {}
            for key in totals:
                totals[key] += int(attrs.get(key, 0))
    return totals


def weight_cache_figures(telemetry_dir: Path) -> dict[str, dict[str, int]]:
    """Each rollout host's weight download cache at its last fetch (its ``rollout.weight_cache`` events):
    ``{host: {"versions": N, "bytes": B}}``; empty where no version was downloaded (``file://`` weights are
    read in place)."""
    hosts: dict[str, dict[str, int]] = {}
    events = read_jsonl(telemetry_dir, types={"event"}) if telemetry_dir.is_dir() else iter(())
    for record in events:
        if record.get("name") == "rollout.weight_cache":
            attrs = record.get("attributes") or {}
            hosts[str(attrs.get("host"))] = {
                "versions": int(attrs.get("versions", 0)),
                "bytes": int(attrs.get("bytes", 0)),
            }
    return hosts


def task_figures(telemetry_dir: Path) -> dict[str, Any]:
    """The tasks work was emitted for and the suite's tasks the env pool does not run, from the data manager's
    latest ``data.stats`` event: ``{"emitted": N, "excluded": M, "excluded_by": {requirement: tasks}}``
    (None before any such event)."""
    last: dict[str, Any] | None = None
    events = read_jsonl(telemetry_dir, types={"event"}) if telemetry_dir.is_dir() else iter(())
    for record in events:
        if record.get("name") == "data.stats":
            last = record.get("attributes") or {}
    if last is None or "tasks" not in last:
        return {"emitted": None, "excluded": None, "excluded_by": {}}
    return {
        "emitted": last.get("tasks"),
        "excluded": last.get("tasks_excluded", 0),
        "excluded_by": dict(last.get("tasks_excluded_by") or {}),
    }


def build_summary(
    run_dir: Path,
    *,
    produced: int,
    versions: int,
    rl_start_ns: int,
    duplicated: int = 0,
    rl_end_ns: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The summary dict printed as the run's last line and written to ``summary.json``."""
    db = run_dir / "data.sqlite3"
    stored = stored_count(db)
    rejected = rejected_counts(db)
    outcomes = trajectory_outcomes(db)
    first, last = quarter_success(outcomes)
    util = utilization_by_kind(run_dir / "telemetry", rl_start_ns, rl_end_ns)
    rl_seconds = (rl_end_ns - rl_start_ns) / 1e9
    idle, gpu = idle_and_gpu(run_dir, rl_start_ns, rl_end_ns)
    return {
        "run_dir": str(run_dir),
        "versions_published": versions,
        **published_figures(run_dir / "telemetry"),
        "trajectories_produced": produced,
        "trajectories_stored": stored,
        "trajectories_duplicated": duplicated,
        "trajectories_lost": produced - stored - sum(rejected.values()),
        "rejected": {"total": sum(rejected.values()), "by_reason": rejected},
        "trainable_trajectories": len(outcomes),
        **step_figures(db),
        "success_rate_first_quarter": first,
        "success_rate_last_quarter": last,
        "success_rate_overall": (sum(s for _, s, _ in outcomes) / len(outcomes)) if outcomes else None,
        "env_utilization": util.get("env"),
        "engine_utilization": util.get("engine"),
        "trainer_utilization": util.get("trainer"),
        "idle_breakdown": idle,
        "gpu": gpu,
        **staleness_figures(run_dir / "telemetry"),
        "retention_deleted": retention_figures(run_dir / "telemetry"),
        "weight_cache": weight_cache_figures(run_dir / "telemetry"),
        "tasks": task_figures(run_dir / "telemetry"),
        "rl_seconds": round(rl_seconds, 1),
        "trajectories_per_minute": round(produced / rl_seconds * 60, 2) if rl_seconds > 0 else None,
        **extra,
    }


def phase_times(summary: dict[str, Any]) -> str:
    """Where the run's time went, one line from its summary: model init, warm start (steps taken of those
    planned, CUT when it was cut, the steps run on each thread count), RL (versions, what ended it) and the
    total, seconds."""
    parts = []
    if summary.get("model_init_s") is not None:
        parts.append(f"model init {summary['model_init_s']} s")
    if summary.get("warm_start_cached"):
        parts.append("warm start reused")
    elif summary.get("warm_start_s") is not None:
        steps, planned = summary.get("warm_start_steps"), summary.get("warm_start_planned_steps")
        cut = " CUT" if summary.get("warm_start_cut") else ""
        by_threads = summary.get("warm_start_steps_by_threads") or {}
        on = "; steps by threads " + ", ".join(f"{n}: {c}" for n, c in by_threads.items()) if by_threads else ""
        parts.append(f"warm start {summary['warm_start_s']} s ({steps} of {planned} steps{cut}{on})")
    versions, ended = summary.get("versions_published"), summary.get("rl_ended_by")
    parts.append(f"RL {summary.get('rl_seconds')} s ({versions} versions, ended by {ended})")
    parts.append(f"total {summary.get('total_seconds')} s")
    return "phases: " + ", ".join(parts)
