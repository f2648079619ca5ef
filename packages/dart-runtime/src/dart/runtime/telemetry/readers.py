"""Readers of busy records in JSONL telemetry: the intervals, and the window they cover.

The analytics built on them (per-resource utilization, the idle breakdown) are in
``dart.cli.analytics``, where the CLI and the benchmarks use them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from dart.runtime.telemetry.busy import BusyInterval
from dart.runtime.telemetry.jsonl import read_jsonl

LIFECYCLE_EVENTS = frozenset({"telemetry.start", "telemetry.stop"})
"""Events every :class:`Telemetry` writes at setup and shutdown; they bound a run's wall time."""


def load_busy_intervals(source: str | Path | Iterable[str | Path]) -> list[BusyInterval]:
    """All ``busy`` intervals in a JSONL file, a directory of them, or a list of them."""
    return [BusyInterval.from_record(r) for r in read_jsonl(source, types={"busy"})]


def observed_window(source: str | Path | Iterable[str | Path]) -> tuple[int, int] | None:
    """``(first, last)`` Unix ns covered by busy records and telemetry start/stop events, if any."""
    lo: int | None = None
    hi: int | None = None
    for rec in read_jsonl(source, types={"busy", "event"}):
        if rec["type"] == "busy":
            points = (int(rec["start_unix_ns"]), int(rec["end_unix_ns"]))
        elif rec.get("name") in LIFECYCLE_EVENTS:
            points = (int(rec["ts_unix_ns"]),) * 2
        else:
            continue
        lo = points[0] if lo is None else min(lo, points[0])
        hi = points[1] if hi is None else max(hi, points[1])
    return None if lo is None or hi is None else (lo, hi)
