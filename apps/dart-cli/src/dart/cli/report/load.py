"""Reading a run directory back: trajectories, telemetry events, busy intervals, config, summary.

A run directory, as ``dart run`` writes it::

    run_dir/config.yaml              the run's composed configuration
    run_dir/summary.json             final figures (absent when the run crashed)
    run_dir/data.sqlite3             dart-data's SQL index (table ``trajectories``)
    run_dir/telemetry/<svc>.jsonl    one JSONL telemetry file per service
    run_dir/artifacts/               the local artifact store

Every piece but the directory itself may be missing; :func:`load_run` records what it could not
read in :attr:`RunData.problems` instead of failing, so a crashed run still gets a report.
The SQLite index is opened read-only with the standard library (the report must not depend on, or
migrate, dart-data's database).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dart.cli.view.errors import NotARunError
from dart.runtime.telemetry import BusyInterval, load_busy_intervals, observed_window, read_jsonl

TRAINABLE_STATUSES = frozenset({"ok", "truncated"})
"""Trajectory statuses whose outcome counts towards success rates (aborted/failed are infra losses)."""

_MARKERS = ("config.yaml", "summary.json", "data.sqlite3", "telemetry")


@dataclass(frozen=True)
class Trajectory:
    """One row of the ``trajectories`` table, the columns the report uses.

    Attributes:
        trajectory_id: Unique id.
        task_id: The task it attempted.
        status: ``ok``, ``truncated``, ``aborted`` or ``failed``.
        reward: Final reward.
        success: Whether the task was solved.
        num_steps: Environment steps taken.
        min_policy_version: Oldest policy version that produced one of its actions.
        max_policy_version: Newest such version.
        started_at: Unix seconds.
        finished_at: Unix seconds.
        pooled: Whether it is a member of the experience pool (a replayed success).
    """

    trajectory_id: str
    task_id: str
    status: str
    reward: float
    success: bool
    num_steps: int
    min_policy_version: int
    max_policy_version: int
    started_at: float
    finished_at: float
    pooled: bool

    @property
    def trainable(self) -> bool:
        """Whether it counts towards success rates: a trainable status and not from the pool."""
        return self.status in TRAINABLE_STATUSES and not self.pooled


@dataclass(frozen=True)
class Event:
    """One telemetry ``event`` record.

    Attributes:
        name: Dotted event name, e.g. ``trainer.step``.
        ts_ns: When it was written, Unix ns.
        service: The service that wrote it.
        attributes: Its attributes.
    """

    name: str
    ts_ns: int
    service: str
    attributes: Mapping[str, Any]


@dataclass
class RunData:
    """Everything the report shows about one run.

    Attributes:
        run_dir: The run directory.
        config: ``config.yaml`` parsed (None when absent or unreadable).
        config_text: ``config.yaml`` as written (empty when absent).
        summary: ``summary.json`` parsed (None when absent, e.g. a crashed run).
        trajectories: Index rows ordered by ``finished_at`` (empty without a database).
        events: Telemetry events by name, each list in time order.
        busy: Busy intervals by resource kind (``env``, ``engine``, ``trainer``).
        start_ns: Run window start, Unix ns (None when nothing was recorded).
        end_ns: Run window end, Unix ns.
        problems: What could not be read, one human-readable line each.
    """

    run_dir: Path
    config: Mapping[str, Any] | None = None
    config_text: str = ""
    summary: Mapping[str, Any] | None = None
    trajectories: list[Trajectory] = field(default_factory=list)
    events: dict[str, list[Event]] = field(default_factory=dict)
    busy: dict[str, list[BusyInterval]] = field(default_factory=dict)
    start_ns: int | None = None
    end_ns: int | None = None
    problems: list[str] = field(default_factory=list)

    def event_list(self, name: str) -> list[Event]:
        """Events called ``name`` in time order (empty when none)."""
        return self.events.get(name, [])

    @property
    def duration_s(self) -> float:
        """Length of the run window in seconds (0 when unknown)."""
        if self.start_ns is None or self.end_ns is None:
            return 0.0
        return max(0, self.end_ns - self.start_ns) / 1e9


def _load_trajectories(db: Path) -> list[Trajectory]:
    # mode=ro: a report never creates or upgrades the database of a run it reads.
    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    try:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(trajectories)")}
        if not columns:
            raise sqlite3.OperationalError("no table trajectories")
        pooled = "pooled" if "pooled" in columns else "0"  # schema version 1 had no pool
        rows = conn.execute(
            "SELECT trajectory_id, task_id, status, reward, success, num_steps, min_policy_version, "
            f"max_policy_version, started_at, finished_at, {pooled} FROM trajectories ORDER BY finished_at"
        ).fetchall()
    finally:
        conn.close()
    return [
        Trajectory(
            trajectory_id=str(r[0]),
            task_id=str(r[1]),
            status=str(r[2]),
            reward=float(r[3]),
            success=bool(r[4]),
            num_steps=int(r[5]),
            min_policy_version=int(r[6]),
            max_policy_version=int(r[7]),
            started_at=float(r[8]),
            finished_at=float(r[9]),
            pooled=bool(r[10]),
        )
        for r in rows
    ]


def _load_events(telemetry_dir: Path) -> dict[str, list[Event]]:
    events: dict[str, list[Event]] = {}
    for rec in read_jsonl(telemetry_dir, types={"event"}):
        try:
            event = Event(str(rec["name"]), int(rec["ts_unix_ns"]), str(rec.get("service", "")), rec["attributes"])
        except (KeyError, TypeError, ValueError):
            continue
        events.setdefault(event.name, []).append(event)
    for items in events.values():
        items.sort(key=lambda e: e.ts_ns)
    return events


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory; missing or broken pieces are noted in :attr:`RunData.problems`.

    Args:
        run_dir: The directory ``dart run`` wrote.

    Raises:
        NotARunError: The path is not a directory, or holds none of ``config.yaml``,
            ``summary.json``, ``data.sqlite3`` and ``telemetry/``.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise NotARunError(root, "not a directory")
    if not any((root / m).exists() for m in _MARKERS):
        raise NotARunError(root, "holds none of " + ", ".join(_MARKERS))
    data = RunData(run_dir=root)

    config_path = root / "config.yaml"
    if config_path.is_file():
        data.config_text = config_path.read_text(encoding="utf-8")
        try:
            loaded = yaml.safe_load(data.config_text)
            data.config = loaded if isinstance(loaded, dict) else None
        except yaml.YAMLError as exc:
            data.problems.append(f"config.yaml is not valid YAML: {exc}")
    else:
        data.problems.append("no config.yaml")

    summary_path = root / "summary.json"
    if summary_path.is_file():
        try:
            loaded = json.loads(summary_path.read_text(encoding="utf-8"))
            data.summary = loaded if isinstance(loaded, dict) else None
        except json.JSONDecodeError as exc:
            data.problems.append(f"summary.json is not valid JSON: {exc}")
    else:
        data.problems.append("no summary.json (the run may have crashed or still be running)")

    db = root / "data.sqlite3"
    if db.is_file():
        try:
            data.trajectories = _load_trajectories(db)
        except sqlite3.Error as exc:
            data.problems.append(f"data.sqlite3 could not be read: {exc}")
    else:
        data.problems.append("no data.sqlite3 (no trajectory index)")

    telemetry = root / "telemetry"
    if telemetry.is_dir():
        data.events = _load_events(telemetry)
        for interval in load_busy_intervals(telemetry):
            data.busy.setdefault(interval.resource_kind, []).append(interval)
        window = observed_window(telemetry)
        if window is not None:
            data.start_ns, data.end_ns = window
    else:
        data.problems.append("no telemetry/ directory")

    if data.start_ns is None and data.trajectories:
        # Without telemetry, the trajectories bound the run.
        data.start_ns = int(min(t.started_at for t in data.trajectories) * 1e9)
        data.end_ns = int(max(t.finished_at for t in data.trajectories) * 1e9)
    return data
