"""Where the time of every resource went: the idle breakdown, from JSONL telemetry.

Both run modes write the same records, so the breakdown is computed the same way for both. Over a
window ``[start, end)`` of ``W`` seconds, each resource kind's capacity (count x ``W``) is split
into categories that add up to it (fractions sum to 1 per kind):

env instances (N; env service ``busy`` records, trajectory runners' ``runner`` records):
    ``busy``: reset/step/evaluate on the instance (the env utilization);
    ``waiting_for_action``: leased, idle while its runner waits for the engine's generation
    (queueing in the engine's batcher included);
    ``waiting_for_weights``: leased, idle while its runner waits for an engine to serve at all
    or at the work item's policy version (engines updating weights);
    ``leased_overhead``: leased, idle for anything else: bus round trips of env calls, prompt
    building, action parsing, lease heartbeats and release;
    ``no_lease``: no runner holds it (no work, or runners busy elsewhere).
    Leased time is a runner's time from lease grant to release done (activities ``leased``,
    ``pick``, ``generate``, ``env_call``).
engines (E; rollout ``busy`` records, ``engine.update.end`` events):
    ``generating`` (a request in flight), ``updating_weights`` (from ``engine.update.end``'s
    ``started_at`` to its timestamp), ``waiting_for_requests`` (the rest).
trainer (1 per ``trainer`` resource): ``training`` (``train_step``), ``publishing`` (``publish``),
    ``waiting_for_batches`` (the rest).
runners (R): ``in_lease``, ``lease_wait`` (asking a full pool), ``waiting_for_work`` (the rest).
pipeline (1): ``barrier_waiting_for_weights``: wall time during which the coupled baseline has
    nothing requested because it waits for the trainer and all engines to reach the next version
    (dart-data's ``data.round`` events: ``sync_s`` before each event); always 0 when decoupled.

Example:
    >>> breakdown = idle_breakdown_from_dir("runs/r1/telemetry", start, end,   # doctest: +SKIP
    ...                                     counts={"env": 8, "engine": 2, "runner": 8, "trainer": 1})
    >>> breakdown.fractions["env"]["waiting_for_action"]                        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dart.runtime.telemetry.busy import BusyInterval, Span, busy_ns
from dart.runtime.telemetry.jsonl import read_jsonl

RUNNER_LEASED = frozenset({"leased", "pick", "generate", "env_call"})
"""Runner activities during which the runner holds an env lease."""
RUNNER_PICK = "pick"
RUNNER_GENERATE = "generate"


@dataclass(frozen=True)
class IdleBreakdown:
    """Seconds and fractions of each resource kind's capacity, per category (see the module docstring).

    Attributes:
        wall_s: Window length, seconds.
        counts: Resources per kind the capacity is computed from.
        seconds: ``{kind: {category: resource-seconds}}``.
        fractions: ``{kind: {category: seconds / (count x wall_s)}}``; each kind's sum is 1.
    """

    wall_s: float
    counts: Mapping[str, int]
    seconds: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    fractions: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def to_dict(self, digits: int = 4) -> dict[str, Any]:
        """JSON-ready fractions (rounded) with the window and counts."""
        return {
            "wall_s": round(self.wall_s, 2),
            "counts": dict(self.counts),
            **{kind: {k: round(v, digits) for k, v in cats.items()} for kind, cats in self.fractions.items()},
        }


def _per_resource(intervals: Iterable[BusyInterval], kind: str, activities: frozenset[str] | None) -> list[list[Span]]:
    out: dict[str, list[Span]] = {}
    for i in intervals:
        if i.resource_kind == kind and (activities is None or i.activity in activities):
            out.setdefault(i.resource_id, []).append((i.start_ns, i.end_ns))
    return list(out.values())


def _sum_busy(groups: list[list[Span]], start_ns: int, end_ns: int) -> int:
    return sum(busy_ns(spans, start_ns, end_ns) for spans in groups)


@dataclass(frozen=True)
class _Window:
    """Busy intervals seen through one window ``[start_ns, end_ns)``."""

    items: list[BusyInterval]
    start_ns: int
    end_ns: int

    def busy(self, kind: str, activities: frozenset[str] | None = None) -> int:
        """Nanoseconds resources of ``kind`` were busy (with one of ``activities``) in the window, summed."""
        return _sum_busy(_per_resource(self.items, kind, activities), self.start_ns, self.end_ns)


def idle_breakdown(
    intervals: Iterable[BusyInterval],
    events: Iterable[Mapping[str, Any]],
    start_ns: int,
    end_ns: int,
    counts: Mapping[str, int],
) -> IdleBreakdown:
    """The idle breakdown of one window (see the module docstring for every category).

    A kind with more resources in the records than its count is computed with the larger number.

    Args:
        intervals: Busy intervals of every service (``env``, ``engine``, ``trainer``, ``runner`` kinds).
        events: Event records (``name``, ``ts_unix_ns``, ``attributes``); ``engine.update.end`` and
            ``data.round`` are used.
        start_ns: Window start, Unix ns.
        end_ns: Window end, Unix ns.
        counts: Resources per kind: ``env``, ``engine``, ``runner``, ``trainer`` (missing kinds are
            left out of the result).

    Raises:
        ValueError: The window is empty or a count is negative.
    """
    if end_ns <= start_ns:
        raise ValueError(f"empty window [{start_ns}, {end_ns})")
    if any(n < 0 for n in counts.values()):
        raise ValueError(f"resource counts must not be negative: {dict(counts)}")
    window = _Window(list(intervals), start_ns, end_ns)
    wall = end_ns - start_ns
    # More resources in the records than configured (a wrong count) must not push a share past 1.
    seen: dict[str, set[str]] = {}
    for i in window.items:
        seen.setdefault(i.resource_kind, set()).add(i.resource_id)
    counts = {k: max(n, len(seen.get(k, ()))) if n else 0 for k, n in counts.items()}
    seconds: dict[str, dict[str, int]] = {}
    if counts.get("env"):
        seconds["env"] = _env_seconds(window, counts["env"] * wall)
    if counts.get("engine"):
        seconds["engine"] = _engine_seconds(window, events, counts["engine"] * wall)
    if counts.get("trainer"):
        seconds["trainer"] = _trainer_seconds(window, counts["trainer"] * wall)
    if counts.get("runner"):
        seconds["runner"] = _runner_seconds(window, counts["runner"] * wall)
    seconds["pipeline"] = _pipeline_seconds(events, start_ns, end_ns)
    seconds_s = {k: {c: v / 1e9 for c, v in cats.items()} for k, cats in seconds.items()}
    caps = {**{k: counts.get(k, 0) * wall for k in seconds}, "pipeline": wall}
    fractions = {k: {c: v / caps[k] for c, v in cats.items()} for k, cats in seconds.items()}
    return IdleBreakdown(wall / 1e9, dict(counts), seconds_s, fractions)


def _env_seconds(window: _Window, cap: int) -> dict[str, int]:
    """Env instances' ``cap`` resource-ns split: busy, leased and idle (by what the runner waited for), no lease."""
    busy = window.busy("env")
    leased = window.busy("runner", RUNNER_LEASED)
    pick = window.busy("runner", frozenset({RUNNER_PICK}))
    gen = window.busy("runner", frozenset({RUNNER_GENERATE}))
    leased = min(max(leased, busy), cap)  # an env is busy only under a lease
    leased_idle = leased - busy
    weights = min(pick, leased_idle)
    action = min(gen, leased_idle - weights)
    return {
        "busy": busy,
        "waiting_for_action": action,
        "waiting_for_weights": weights,
        "leased_overhead": leased_idle - weights - action,
        "no_lease": cap - leased,
    }


def _engine_seconds(window: _Window, events: Iterable[Mapping[str, Any]], cap: int) -> dict[str, int]:
    """Engines' ``cap`` resource-ns split: generating, updating weights (``engine.update.end`` events), waiting."""
    gen = window.busy("engine")
    updates: dict[str, list[Span]] = {}
    for ev in events:
        if ev.get("name") != "engine.update.end":
            continue
        attrs = ev.get("attributes", {})
        end = int(ev["ts_unix_ns"])
        begin = int(float(attrs.get("started_at", end / 1e9)) * 1e9)
        updates.setdefault(str(attrs.get("engine_id")), []).append((begin, end))
    updating = min(_sum_busy(list(updates.values()), window.start_ns, window.end_ns), max(0, cap - gen))
    return {"generating": gen, "updating_weights": updating, "waiting_for_requests": cap - gen - updating}


def _trainer_seconds(window: _Window, cap: int) -> dict[str, int]:
    """The trainer's ``cap`` resource-ns split: training, publishing (anything else it did), waiting."""
    train = window.busy("trainer", frozenset({"train_step"}))
    other = window.busy("trainer") - train
    return {"training": train, "publishing": other, "waiting_for_batches": max(0, cap - train - other)}


def _runner_seconds(window: _Window, cap: int) -> dict[str, int]:
    """Runners' ``cap`` resource-ns split: in a lease, waiting for one, waiting for work."""
    in_lease = window.busy("runner", RUNNER_LEASED)
    # A runner's tracker never overlaps itself; the union keeps the split exact even if it did.
    lease_wait = window.busy("runner") - in_lease
    return {"in_lease": in_lease, "lease_wait": lease_wait, "waiting_for_work": max(0, cap - in_lease - lease_wait)}


def _pipeline_seconds(events: Iterable[Mapping[str, Any]], start_ns: int, end_ns: int) -> dict[str, int]:
    """The window's ns split: the coupled baseline's barrier waits (``data.round`` events' ``sync_s``), the rest."""
    barrier: list[Span] = []
    for ev in events:
        if ev.get("name") == "data.round":
            ts = int(ev["ts_unix_ns"])
            barrier.append((ts - int(float(ev.get("attributes", {}).get("sync_s", 0.0)) * 1e9), ts))
    waited = busy_ns(barrier, start_ns, end_ns)
    return {"barrier_waiting_for_weights": waited, "running": end_ns - start_ns - waited}


def idle_breakdown_from_dir(
    telemetry: str | Path, start_ns: int, end_ns: int, counts: Mapping[str, int]
) -> IdleBreakdown:
    """:func:`idle_breakdown` of a run's telemetry directory (or one JSONL file)."""
    intervals: list[BusyInterval] = []
    events: list[dict[str, Any]] = []
    for rec in read_jsonl(telemetry, types={"busy", "event"}):
        if rec["type"] == "busy":
            intervals.append(BusyInterval.from_record(rec))
        elif rec.get("name") in ("engine.update.end", "data.round"):
            events.append(rec)
    return idle_breakdown(intervals, events, start_ns, end_ns, counts)
