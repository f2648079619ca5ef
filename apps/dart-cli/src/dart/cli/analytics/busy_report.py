"""Per-resource utilization computed from JSONL telemetry files (what benchmarks and reports use).

Example:
    >>> stats = resource_utilization("runs/r1/telemetry")          # doctest: +SKIP
    >>> for (kind, rid), u in sorted(stats.items()):                # doctest: +SKIP
    ...     print(kind, rid, f"{u.utilization:.1%}", u.by_activity)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dart.runtime.telemetry import BusyInterval, busy_ns, load_busy_intervals, observed_window


@dataclass(frozen=True)
class ResourceUtilization:
    """How busy one resource was during a window.

    Attributes:
        resource_kind: e.g. ``env``.
        resource_id: e.g. ``env-3``.
        start_ns: Window start, Unix ns.
        end_ns: Window end, Unix ns.
        busy_s: Busy seconds within the window (overlaps counted once).
        wall_s: Window length in seconds.
        utilization: ``busy_s / wall_s`` (0 for an empty window).
        by_activity: Busy seconds within the window per activity.
    """

    resource_kind: str
    resource_id: str
    start_ns: int
    end_ns: int
    busy_s: float
    wall_s: float
    utilization: float
    by_activity: Mapping[str, float] = field(default_factory=dict)


def resource_utilization(
    source: str | Path | Iterable[str | Path],
    *,
    start_ns: int | None = None,
    end_ns: int | None = None,
    resource_kind: str | None = None,
) -> dict[tuple[str, str], ResourceUtilization]:
    """Utilization of every resource found in JSONL telemetry, over one common window.

    Args:
        source: A JSONL file, a directory searched recursively, or a list of them.
        start_ns: Window start (Unix ns); default: the earliest busy record or service start.
        end_ns: Window end (Unix ns); default: the latest busy record or service stop.
        resource_kind: Only resources of this kind.

    Returns:
        ``{(resource_kind, resource_id): ResourceUtilization}``; empty when there is no record.
    """
    intervals = [i for i in load_busy_intervals(source) if resource_kind is None or i.resource_kind == resource_kind]
    if start_ns is None or end_ns is None:
        seen = observed_window(source)
        if seen is None:
            return {}
        start_ns = seen[0] if start_ns is None else start_ns
        end_ns = seen[1] if end_ns is None else end_ns
    by_resource: dict[tuple[str, str], list[BusyInterval]] = {}
    for interval in intervals:
        by_resource.setdefault((interval.resource_kind, interval.resource_id), []).append(interval)
    wall_ns = max(0, end_ns - start_ns)
    out: dict[tuple[str, str], ResourceUtilization] = {}
    for key, items in sorted(by_resource.items()):
        activities: dict[str, list[BusyInterval]] = {}
        for item in items:
            activities.setdefault(item.activity, []).append(item)
        total = busy_ns(items, start_ns, end_ns)
        out[key] = ResourceUtilization(
            resource_kind=key[0],
            resource_id=key[1],
            start_ns=start_ns,
            end_ns=end_ns,
            busy_s=total / 1e9,
            wall_s=wall_ns / 1e9,
            utilization=total / wall_ns if wall_ns else 0.0,
            by_activity={a: busy_ns(v, start_ns, end_ns) / 1e9 for a, v in sorted(activities.items())},
        )
    return out
