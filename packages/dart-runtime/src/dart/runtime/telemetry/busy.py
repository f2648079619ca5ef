"""Busy/idle accounting of resources (environments, inference engines, the trainer).

DART's point is that environments, inference and training never wait for each other; this module
is how that claim is measured. A :class:`BusyTracker` per resource records when it is busy and
doing what, as disjoint intervals written to the JSONL sink (``busy`` records) and as an OTel
counter of busy seconds. The pure functions below turn intervals back into utilization numbers
and timelines, exactly (integer nanoseconds, no sampling).

Example:
    >>> tracker = BusyTracker("env", "env-0", telemetry)     # doctest: +SKIP
    >>> with tracker.busy("step"):                            # doctest: +SKIP
    ...     env.step(action)
    >>> async with tracker.busy("reset"):                     # doctest: +SKIP
    ...     await env.reset(task)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

Clock = Callable[[], int]
"""A clock returning Unix time in integer nanoseconds (``time.time_ns`` by default)."""


@dataclass(frozen=True, slots=True)
class BusyInterval:
    """One period during which a resource was busy with one activity.

    Attributes:
        resource_kind: What the resource is, e.g. ``env``, ``engine``, ``trainer``.
        resource_id: Which one, unique within its kind.
        activity: What it was doing, e.g. ``step``, ``generate``, ``train_step``.
        start_ns: Start, Unix time in nanoseconds.
        end_ns: End, Unix time in nanoseconds (``>= start_ns``).
    """

    resource_kind: str
    resource_id: str
    activity: str
    start_ns: int
    end_ns: int

    @property
    def duration_s(self) -> float:
        """Length in seconds."""
        return (self.end_ns - self.start_ns) / 1e9

    def to_record(self) -> dict[str, Any]:
        """The type-specific fields of this interval's JSONL ``busy`` record."""
        return {
            "resource_kind": self.resource_kind,
            "resource_id": self.resource_id,
            "activity": self.activity,
            "start_unix_ns": self.start_ns,
            "end_unix_ns": self.end_ns,
            "duration_s": self.duration_s,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> BusyInterval:
        """Rebuild an interval from a JSONL ``busy`` record."""
        return cls(
            str(record["resource_kind"]),
            str(record["resource_id"]),
            str(record["activity"]),
            int(record["start_unix_ns"]),
            int(record["end_unix_ns"]),
        )


Span = tuple[int, int]


def _as_span(item: BusyInterval | Span) -> Span:
    return (item.start_ns, item.end_ns) if isinstance(item, BusyInterval) else (int(item[0]), int(item[1]))


def merge_intervals(items: Iterable[BusyInterval | Span]) -> list[Span]:
    """Union of intervals as sorted, disjoint ``(start_ns, end_ns)`` pairs (touching ones merged)."""
    spans = sorted(s for s in map(_as_span, items) if s[1] > s[0])
    merged: list[Span] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def busy_ns(items: Iterable[BusyInterval | Span], start_ns: int, end_ns: int) -> int:
    """Nanoseconds of ``[start_ns, end_ns)`` covered by the union of ``items``."""
    total = 0
    for s, e in merge_intervals(items):
        lo, hi = max(s, start_ns), min(e, end_ns)
        if hi > lo:
            total += hi - lo
    return total


def utilization(items: Iterable[BusyInterval | Span], start_ns: int, end_ns: int) -> float:
    """Busy fraction of the window ``[start_ns, end_ns)``: union of busy time / wall time.

    Overlapping intervals are counted once. An empty window has utilization 0.
    """
    if end_ns <= start_ns:
        return 0.0
    return busy_ns(items, start_ns, end_ns) / (end_ns - start_ns)


def utilization_timeline(
    items: Iterable[BusyInterval | Span], start_ns: int, end_ns: int, bucket_ns: int
) -> list[tuple[int, float]]:
    """Utilization per time bucket, for plotting: ``[(bucket_start_ns, fraction), ...]``.

    The last bucket may be shorter than ``bucket_ns``; its fraction is relative to its own length.

    Raises:
        ValueError: ``bucket_ns`` is not positive.
    """
    if bucket_ns <= 0:
        raise ValueError(f"bucket_ns must be positive, got {bucket_ns}")
    merged = merge_intervals(items)
    out: list[tuple[int, float]] = []
    i = 0
    t = start_ns
    while t < end_ns:
        hi_b = min(t + bucket_ns, end_ns)
        # Intervals are sorted and disjoint: skip those that ended before this bucket, then
        # sum the overlaps without advancing past one that may reach into the next bucket.
        while i < len(merged) and merged[i][1] <= t:
            i += 1
        covered = 0
        j = i
        while j < len(merged) and merged[j][0] < hi_b:
            covered += min(merged[j][1], hi_b) - max(merged[j][0], t)
            j += 1
        out.append((t, covered / (hi_b - t)))
        t = hi_b
    return out


class BusySection:
    """One busy section: a context manager usable with ``with`` and ``async with`` (once)."""

    def __init__(self, tracker: BusyTracker, activity: str) -> None:
        self._tracker = tracker
        self._activity = activity
        self._token: int | None = None

    def __enter__(self) -> BusySection:
        if self._token is not None:
            raise RuntimeError("a BusySection can be entered once; call tracker.busy() again")
        self._token = self._tracker.begin(self._activity)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._token is not None:
            self._tracker.end(self._token)

    async def __aenter__(self) -> BusySection:
        return self.__enter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.__exit__(exc_type, exc, tb)


class BusySink(Protocol):
    """Where a :class:`BusyTracker` reports; :class:`dart.runtime.telemetry.setup.Telemetry` is one.

    A protocol rather than the class itself, so this module does not depend on the telemetry setup
    (which depends on it).
    """

    def track_busy(self, tracker: BusyTracker) -> None:
        """Keep ``tracker`` (weakly) to checkpoint it at flush and shutdown."""

    def record_busy(self, tracker: BusyTracker, interval: BusyInterval | None, busy_delta: int) -> None:
        """Record a finished ``interval`` of ``tracker`` and a change of its busy gauge (+1, -1 or 0)."""


class BusyTracker:
    """Busy/idle accounting for one resource.

    The resource is busy while at least one section is open. Busy time is cut into disjoint
    segments, each attributed to a single activity: that of the most recently opened section still
    open. A nested section thus refines its parent (like a profiler's self time) and among
    concurrent sections (an engine serving several requests) the newest wins; either way nothing is
    counted twice and the per-activity totals add up to the busy time.

    Lifecycle: ``idle`` -> ``busy`` when the first section opens -> ``idle`` when the last one
    closes. A segment is emitted when its activity changes, when the resource goes idle, and on
    :meth:`checkpoint` (which the owning telemetry calls at shutdown, and which long sections may
    call to make timelines current); emitting hands the interval to the telemetry
    (:meth:`BusySink.record_busy`), which writes a ``busy`` JSONL record and adds to the
    ``dart.resource.busy.time`` counter. ``dart.resource.busy`` (an up-down counter) is 1 while the
    resource is busy.

    Thread-safe; usable from asyncio code (nothing blocks beyond one small file append).

    Args:
        resource_kind: What the resource is (``env``, ``engine``, ``trainer``); metric attribute
            ``resource.kind``.
        resource_id: Which one; metric attribute ``resource.id``.
        telemetry: Where records and metrics go; None keeps the accounting in memory only.
        clock: Unix time in integer nanoseconds; injectable so tests are exact.
        retain: How many finished intervals to keep in memory for :meth:`utilization`.
    """

    def __init__(
        self,
        resource_kind: str,
        resource_id: str,
        telemetry: BusySink | None = None,
        *,
        clock: Clock = time.time_ns,
        retain: int = 10_000,
    ) -> None:
        self.resource_kind = resource_kind
        self.resource_id = resource_id
        self._telemetry = telemetry
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[int, str] = {}
        self._next_token = 0
        self._seg_start: int | None = None
        self._seg_activity = ""
        self._intervals: deque[BusyInterval] = deque(maxlen=retain)
        self._totals_ns: dict[str, int] = {}
        self.created_ns = clock()
        """When the tracker was created (Unix ns): the start of :meth:`utilization`'s default window."""
        if telemetry is not None:
            telemetry.track_busy(self)

    def busy(self, activity: str = "busy") -> BusySection:
        """A section during which the resource is busy with ``activity``.

        Example:
            >>> with tracker.busy("step"):       # doctest: +SKIP
            ...     ...
        """
        return BusySection(self, activity)

    @property
    def is_busy(self) -> bool:
        """Whether any section is open."""
        return bool(self._open)

    def begin(self, activity: str = "busy") -> int:
        """Open a section without a ``with`` block; returns a token for :meth:`end`."""
        emitted: BusyInterval | None = None
        with self._lock:
            now = self._clock()
            token = self._next_token
            self._next_token += 1
            became_busy = not self._open
            if became_busy:
                self._seg_start, self._seg_activity = now, activity
            elif activity != self._seg_activity:
                emitted = self._cut(now)
                self._seg_activity = activity
            self._open[token] = activity
        self._emit(emitted, +1 if became_busy else 0)
        return token

    def end(self, token: int) -> None:
        """Close the section opened by :meth:`begin`.

        Raises:
            ValueError: The token is unknown or its section already ended.
        """
        emitted: BusyInterval | None = None
        with self._lock:
            now = self._clock()
            if self._open.pop(token, None) is None:
                raise ValueError(f"busy section {token} of {self.resource_kind}/{self.resource_id} is not open")
            became_idle = not self._open
            if became_idle:
                emitted = self._cut(now)
                self._seg_start = None
            else:
                newest = next(reversed(self._open.values()))
                if newest != self._seg_activity:
                    emitted = self._cut(now)
                    self._seg_activity = newest
        self._emit(emitted, -1 if became_idle else 0)

    def checkpoint(self) -> None:
        """Emit the segment in progress up to now (the resource stays busy)."""
        emitted: BusyInterval | None = None
        with self._lock:
            if self._seg_start is not None:
                emitted = self._cut(self._clock())
        self._emit(emitted, 0)

    def _cut(self, now: int) -> BusyInterval | None:
        # Ends the current segment at `now` and starts the next one there. Called with the lock
        # held. A clock that stepped backwards yields an empty segment rather than a negative one.
        assert self._seg_start is not None
        start = self._seg_start
        end = max(now, start)
        self._seg_start = end
        if end == start:
            return None
        interval = BusyInterval(self.resource_kind, self.resource_id, self._seg_activity, start, end)
        self._intervals.append(interval)
        self._totals_ns[interval.activity] = self._totals_ns.get(interval.activity, 0) + end - start
        return interval

    def _emit(self, interval: BusyInterval | None, busy_delta: int) -> None:
        if self._telemetry is not None and (interval is not None or busy_delta):
            self._telemetry.record_busy(self, interval, busy_delta)

    def intervals(self) -> list[BusyInterval]:
        """Finished intervals still retained in memory (oldest first)."""
        with self._lock:
            return list(self._intervals)

    def totals(self, now_ns: int | None = None) -> dict[str, float]:
        """Busy seconds per activity since creation, including the section in progress."""
        with self._lock:
            totals = dict(self._totals_ns)
            if self._seg_start is not None:
                now = self._clock() if now_ns is None else now_ns
                totals[self._seg_activity] = totals.get(self._seg_activity, 0) + max(0, now - self._seg_start)
        return {k: v / 1e9 for k, v in totals.items()}

    @property
    def busy_seconds(self) -> float:
        """Total busy seconds since creation, including the section in progress."""
        return sum(self.totals().values())

    def utilization(self, window_s: float | None = None, *, now_ns: int | None = None) -> float:
        """Busy fraction over the last ``window_s`` seconds (since creation when None).

        Computed from retained intervals plus the section in progress; a window reaching further
        back than the retained intervals undercounts, so size ``retain`` for the windows you ask.
        """
        with self._lock:
            now = self._clock() if now_ns is None else now_ns
            spans: list[Span] = [(i.start_ns, i.end_ns) for i in self._intervals]
            if self._seg_start is not None:
                spans.append((self._seg_start, now))
        start = self.created_ns if window_s is None else now - int(window_s * 1e9)
        return utilization(spans, start, now)
