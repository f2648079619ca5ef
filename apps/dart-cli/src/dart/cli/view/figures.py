"""The run's figures from its services' telemetry: what the overview shows beside the index's counts.

Computed by the functions that compute ``dart run``'s summary, over the same window: the RL window that
``dart run`` records (``rl_window.json`` when it opens, ``summary.json``'s ``rl_start_unix_ns`` /
``rl_end_unix_ns`` when the run ends). While the run goes, the window runs from its start to now, so a
finished run's page and its summary agree to the digit. A run directory written before the window was
recorded, and a deployment, fall back to the span their telemetry covers, and say so. With no end
recorded, the run counts as going on while its services write telemetry (they export every few
seconds), and as ended at its last record once they have been quiet for :data:`QUIET_S` seconds.

Telemetry is the services' JSONL (``<run_dir>/telemetry``, or ``dart view --telemetry DIR`` for a
deployment whose services write to a shared directory). Reading it costs a pass over the files, so
:class:`FiguresCache` reads them again only when they changed, and at most every
:data:`REFRESH_S` seconds.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dart.cli.stack.run_record import RL_WINDOW_FILE
from dart.cli.stack.summary import staleness_figures, utilization_by_kind
from dart.runtime.telemetry import observed_window, read_jsonl

RESOURCE_KINDS = ("env", "engine", "trainer")
"""The resource kinds whose utilization the overview shows (the summary's three)."""
REFRESH_S = 5.0
"""Shortest time between two reads of a live run's telemetry."""
QUIET_S = 60.0
"""A run with no recorded end whose services wrote no telemetry for this long has ended."""


@dataclass(frozen=True)
class HeldOut:
    """One held-out evaluation (a ``validation.heldout`` event).

    Attributes:
        version: The policy version evaluated.
        success: Greedy success rate.
        low: 95% Wilson interval, lower bound.
        high: Upper bound.
        n: Episodes counted.
    """

    version: int
    success: float
    low: float
    high: float
    n: int


@dataclass(frozen=True)
class RunFigures:
    """What the telemetry says about the run over its RL window.

    Attributes:
        start_ns: Window start, Unix ns (None without telemetry).
        end_ns: Window end: the run's end, or now while it goes.
        live: Whether the run is still going (no end recorded).
        window: How the window was chosen, in words.
        utilization: Mean busy fraction per resource kind (kinds with no record are absent).
        versions_published: ``trainer.published`` events.
        latest_published: The newest version published (None before the first).
        heldout: Held-out evaluations, by version.
        staleness: The summary's staleness figures (largest trained lag, drops, throttles).
        missing: Why there are no figures (empty when there are).
    """

    start_ns: int | None = None
    end_ns: int | None = None
    live: bool = False
    window: str = ""
    utilization: dict[str, float] = field(default_factory=dict)
    versions_published: int = 0
    latest_published: int | None = None
    heldout: list[HeldOut] = field(default_factory=list)
    staleness: dict[str, Any] = field(default_factory=dict)
    missing: str = ""

    @property
    def minutes(self) -> float:
        """The window's length in minutes (0 when unknown)."""
        if self.start_ns is None or self.end_ns is None:
            return 0.0
        return max(0.0, (self.end_ns - self.start_ns) / 60e9)


def run_window(run_dir: Path | None, summary: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """The RL window ``dart run`` recorded: ``(start, end)`` in Unix ns; end None while the run goes,
    both None when nothing was recorded (a deployment, or a run directory from before)."""
    if summary is not None and summary.get("rl_start_unix_ns") and summary.get("rl_end_unix_ns"):
        return int(summary["rl_start_unix_ns"]), int(summary["rl_end_unix_ns"])
    if run_dir is None:
        return None, None
    try:
        recorded = json.loads((run_dir / RL_WINDOW_FILE).read_text())
        return int(recorded["rl_start_unix_ns"]), None
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def compute(telemetry: Path | None, run_dir: Path | None, summary: dict[str, Any] | None) -> RunFigures:
    """The figures of the run, from its telemetry directory and recorded window.

    Without telemetry to tell, a deployment counts as going on (its index keeps changing) and a run
    directory as ended.
    """
    deployment = run_dir is None
    if telemetry is None:
        missing = "no telemetry directory: start dart view with --telemetry DIR (the services' JSONL)"
        return RunFigures(live=deployment, missing=missing)
    if not telemetry.is_dir():
        missing = f"{telemetry} does not exist (the services write their telemetry there)"
        return RunFigures(live=deployment, missing=missing)
    start, end = run_window(run_dir, summary)
    observed = observed_window(telemetry)
    if observed is None and start is None:
        return RunFigures(live=deployment, missing=f"{telemetry} holds no telemetry record yet")
    how = "the RL window dart run recorded"
    if start is None:
        assert observed is not None
        start, how = observed[0], "the span the telemetry covers (no RL window was recorded)"
    live = False
    if end is None:
        # No end recorded: the run goes on while its services still write (they export every few
        # seconds); otherwise it ended (crashed, or a deployment stopped) with its last record.
        live = summary is None and time.time() - _newest_write(telemetry) < QUIET_S
        end = time.time_ns() if live or observed is None else observed[1]
        how += ", up to now" if live else ", up to the last record"
    else:
        how += " (as the summary)"
    versions, latest, heldout = _events(telemetry)
    return RunFigures(
        start_ns=start,
        end_ns=end,
        live=live,
        window=how,
        utilization=utilization_by_kind(telemetry, start, end),
        versions_published=versions,
        latest_published=latest,
        heldout=heldout,
        staleness=staleness_figures(telemetry),
    )


def _newest_write(telemetry: Path) -> float:
    """When a service last wrote telemetry (Unix seconds; 0 when none did)."""
    return max((mtime / 1e9 for _, _, mtime in _state(telemetry)), default=0.0)


def _events(telemetry: Path) -> tuple[int, int | None, list[HeldOut]]:
    """Versions published, the newest of them, and the held-out evaluations."""
    versions, latest = 0, None
    heldout: dict[int, HeldOut] = {}
    for record in read_jsonl(telemetry, types={"event"}):
        name, attrs = record.get("name"), record.get("attributes") or {}
        if name == "trainer.published":
            versions += 1
            if "version" in attrs:
                latest = max(int(attrs["version"]), latest if latest is not None else -1)
        elif name == "validation.heldout" and attrs.get("success") is not None:
            point = HeldOut(
                int(attrs["version"]),
                float(attrs["success"]),
                float(attrs["ci95_low"]),
                float(attrs["ci95_high"]),
                int(attrs["n"]),
            )
            heldout[point.version] = point
    return versions, latest, [heldout[v] for v in sorted(heldout)]


class FiguresCache:
    """The figures of one run, read again only when its telemetry changed and :data:`REFRESH_S` passed.

    Thread-safe: the viewer's pages are served from a thread pool.
    """

    def __init__(self, telemetry: Path | None, run_dir: Path | None, summary: Callable[[], dict[str, Any] | None]):
        self.telemetry = telemetry
        self.run_dir = run_dir
        self.summary = summary
        self._lock = threading.Lock()
        self._key: tuple[Any, ...] | None = None
        self._at = 0.0
        self._figures = RunFigures()

    def get(self) -> RunFigures:
        """The figures, recomputed when the telemetry changed (at most every :data:`REFRESH_S` seconds)."""
        with self._lock:
            now = time.monotonic()
            if self._key is not None and now - self._at < REFRESH_S:
                return self._figures
            summary = self.summary()
            key = (_state(self.telemetry), summary is None)
            # A live run's window grows even when nothing new was written.
            if key != self._key or self._figures.live:
                self._figures = compute(self.telemetry, self.run_dir, summary)
                self._key = key
            self._at = now
            return self._figures


def _state(telemetry: Path | None) -> tuple[tuple[str, int, int], ...]:
    """Each JSONL file's name, size and modification time: what changes when a service writes."""
    if telemetry is None or not telemetry.is_dir():
        return ()
    out = []
    for path in sorted(telemetry.rglob("*.jsonl")):
        try:
            st = path.stat()
        except OSError:
            continue
        out.append((str(path), st.st_size, st.st_mtime_ns))
    return tuple(out)
