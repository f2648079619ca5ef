"""The SQL the viewer runs on a run's index: SELECTs only, on dart-data's own table definitions.

The index is opened read-only (SQLite with ``mode=ro``; PostgreSQL in read-only transactions) and never
migrated: a schema other than the one this code reads is refused with the versions named.

Trajectory lists are ordered by ``trajectory_id`` and paged by keyset (``after`` / ``before`` an id), so
every page is a walk of the primary-key index that stops after one page of matches, however many rows
the index holds. Ids are ``traj-<group>-<rollout>``, so this order also keeps a group's rollouts
together. The index has no index on finish time, and the viewer must not add one to the data
manager's schema; ordering 100,000 rows by time would sort them all on every page.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, Engine, Integer, and_, cast, create_engine, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import QueuePool

from dart.cli.view.errors import NotARunError
from dart.data.schema import (
    LATEST_VERSION,
    rejected_trajectories,
    rollout_groups,
    schema_version,
    trajectories,
    work_items,
)
from dart.protocol.messages import TRAINABLE_STATUSES

PAGE_SIZE = 50
"""Rows of a trajectory list page."""

_TRAINABLE = sorted(s.value for s in TRAINABLE_STATUSES)
_LIST_COLUMNS = (
    "trajectory_id",
    "task_id",
    "group_id",
    "rollout_index",
    "status",
    "reward",
    "success",
    "num_steps",
    "parse_errors",
    "min_policy_version",
    "max_policy_version",
    "finished_at",
    "pooled",
    "pruned_at",
    "parent_trajectory_id",
    "branch_step",
    "branch_refused",
)


@dataclass(frozen=True)
class TrajectoryFilter:
    """What a trajectory list shows; every field None shows everything.

    Attributes:
        task_id: Only this task's trajectories.
        status: Only this status (``ok``, ``truncated``, ``aborted``, ``env_failed``, ``failed``).
        success: Only successes (True) or only the others (False).
        min_version: Only trajectories whose every step came from this policy version or a newer one.
        max_version: Only trajectories whose every step came from this policy version or an older one.
        group_id: Only this group's rollouts.
    """

    task_id: str | None = None
    status: str | None = None
    success: bool | None = None
    min_version: int | None = None
    max_version: int | None = None
    group_id: str | None = None

    def clauses(self) -> list[ColumnElement[bool]]:
        """The WHERE clauses of this filter (task and group equality use their indexes)."""
        t = trajectories.c
        out: list[ColumnElement[bool]] = []
        if self.task_id is not None:
            out.append(t.task_id == self.task_id)
        if self.group_id is not None:
            out.append(t.group_id == self.group_id)
        if self.status is not None:
            out.append(t.status == self.status)
        if self.success is not None:
            out.append(t.success.is_(self.success))
        if self.min_version is not None:
            out.append(t.min_policy_version >= self.min_version)
        if self.max_version is not None:
            out.append(t.max_policy_version <= self.max_version)
        return out


@dataclass(frozen=True)
class Page:
    """One page of a trajectory list.

    Attributes:
        rows: Up to :data:`PAGE_SIZE` rows in ``trajectory_id`` order.
        total: Rows matching the filter, all pages.
        next_after: Cursor of the next page (its rows come after this id), None on the last page.
        prev_before: Cursor of the previous page (its rows come before this id), None on the first page.
    """

    rows: list[dict[str, Any]]
    total: int
    next_after: str | None
    prev_before: str | None


@dataclass(frozen=True)
class Overview:
    """The figures of the overview page, from the index.

    Attributes:
        total: Stored trajectories.
        by_status: Trajectories per status.
        trainable: Trajectories counted in success rates: a trainable status, not a pool member
            (as the run summary counts them).
        successes: Successes among ``trainable``.
        by_version: ``(max_policy_version, trainable, successes)`` per version, oldest first.
        rejections: Deliveries refused at ingestion, per reason.
        pool_size: Members of the experience pool.
        pruned: Trajectories whose blobs retention deleted.
        latest_version: Newest policy version of any stored step (None when nothing is stored).
        groups_by_status: Rollout groups per status (``open``, ``emitted``, ``dropped``).
    """

    total: int
    by_status: dict[str, int]
    trainable: int
    successes: int
    by_version: list[tuple[int, int, int]]
    rejections: dict[str, int]
    pool_size: int
    pruned: int
    latest_version: int | None
    groups_by_status: dict[str, int]


@dataclass(frozen=True)
class Group:
    """A rollout group as the index holds it.

    Attributes:
        group_id: The group.
        row: Its ``rollout_groups`` row (None when the index has none, e.g. work emitted elsewhere).
        members: Its stored trajectories' rows, in rollout order (a rollout's branches after it).
        planned: Rollout indices of its work items, branches left out (what the group was meant to hold).
    """

    group_id: str
    row: dict[str, Any] | None
    members: list[dict[str, Any]]
    planned: list[int]


def read_only_engine(url: str) -> Engine:
    """An engine on the index that cannot write: SQLite opened ``mode=ro``, PostgreSQL in read-only transactions.

    Raises:
        NotARunError: A SQLite index file that does not exist.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = Path(parsed.database or "")
        if not path.is_file():
            raise NotARunError(path, "no such index file")
        uri = f"{path.resolve().as_uri()}?mode=ro"

        def connect() -> sqlite3.Connection:
            return sqlite3.connect(uri, uri=True, check_same_thread=False)

        return create_engine("sqlite://", creator=connect, poolclass=QueuePool)
    if parsed.get_backend_name() == "postgresql":
        return create_engine(url, connect_args={"options": "-c default_transaction_read_only=on"})
    return create_engine(url)


class RunIndex:
    """Read-only queries on one run's index (synchronous: the web app calls them from its thread pool)."""

    def __init__(self, engine: Engine, where: str = "the index") -> None:
        """Query ``engine``; ``where`` names the index in errors (its file, or its URL without password)."""
        self.engine = engine
        self.where = where

    def close(self) -> None:
        """Release pooled connections."""
        self.engine.dispose()

    def check_schema(self) -> None:
        """Make sure the index is one this code reads.

        Raises:
            NotARunError: No schema, or another version than :data:`LATEST_VERSION`.
        """
        where = Path(self.where)
        try:
            conn = self.engine.connect()
        except SQLAlchemyError as exc:
            first = str(exc.args[0]).splitlines()[0]
            raise NotARunError(where, f"its database cannot be reached ({type(exc).__name__}: {first})") from exc
        try:
            with conn:
                version = conn.execute(select(func.max(schema_version.c.version))).scalar_one()
        except SQLAlchemyError as exc:
            raise NotARunError(where, f"it is not a trajectory index ({type(exc).__name__}: {exc.args[0]})") from exc
        if version != LATEST_VERSION:
            raise NotARunError(
                where,
                f"the index has schema version {version} and this dart view reads version {LATEST_VERSION} "
                "(it never migrates an index: use the dart version that wrote the run)",
            )

    def overview(self) -> Overview:
        """The overview page's figures: two passes over ``trajectories`` (per status, per version) and the
        small ``rejected_trajectories`` and ``rollout_groups`` tables."""
        t, g, r = trajectories.c, rollout_groups.c, rejected_trajectories.c
        counted = and_(t.status.in_(_TRAINABLE), t.pooled.is_(False))
        with self.engine.connect() as conn:
            per_status = conn.execute(
                select(
                    t.status,
                    func.count(),
                    func.sum(cast(t.pooled, Integer)),
                    func.count(t.pruned_at),
                    func.max(t.max_policy_version),
                ).group_by(t.status)
            ).all()
            versions = conn.execute(
                select(t.max_policy_version, func.count(), func.sum(cast(t.success, Integer)))
                .where(counted)
                .group_by(t.max_policy_version)
                .order_by(t.max_policy_version)
            ).all()
            rejections = _counts(conn.execute(select(r.reason, func.count()).group_by(r.reason)).all())
            groups = _counts(conn.execute(select(g.status, func.count()).group_by(g.status)).all())
        by_version = [(int(v), int(n), int(s or 0)) for v, n, s in versions]
        latest = [int(row[4]) for row in per_status if row[4] is not None]
        return Overview(
            total=sum(int(row[1]) for row in per_status),
            by_status=_counts([(row[0], row[1]) for row in per_status]),
            trainable=sum(n for _, n, _ in by_version),
            successes=sum(s for _, _, s in by_version),
            by_version=by_version,
            rejections=rejections,
            pool_size=sum(int(row[2] or 0) for row in per_status),
            pruned=sum(int(row[3]) for row in per_status),
            latest_version=max(latest) if latest else None,
            groups_by_status=groups,
        )

    def finished_between(self, start_s: float, end_s: float) -> int:
        """Trajectories stored that finished within ``[start_s, end_s]`` (Unix seconds), every status."""
        t = trajectories.c
        with self.engine.connect() as conn:
            count = conn.execute(select(func.count()).where(t.finished_at.between(start_s, end_s))).scalar_one()
        return int(count)

    def newest(self, count: int) -> list[dict[str, Any]]:
        """The list rows of the ``count`` trajectories that finished last, in ``trajectory_id`` order."""
        t = trajectories.c
        latest = select(t.trajectory_id).order_by(t.finished_at.desc(), t.trajectory_id).limit(count)
        stmt = select(*[t[name] for name in _LIST_COLUMNS]).where(t.trajectory_id.in_(latest))
        with self.engine.connect() as conn:
            return [dict(m) for m in conn.execute(stmt.order_by(t.trajectory_id)).mappings()]

    def page(self, where: TrajectoryFilter, *, after: str | None = None, before: str | None = None) -> Page:
        """One page of the trajectories matching ``where``: the first, the one after id ``after``, or the
        one before id ``before``."""
        t = trajectories.c
        clauses = where.clauses()
        columns = [t[name] for name in _LIST_COLUMNS]
        stmt = select(*columns).where(*clauses)
        if before is not None:
            stmt = stmt.where(t.trajectory_id < before).order_by(t.trajectory_id.desc())
        else:
            if after is not None:
                stmt = stmt.where(t.trajectory_id > after)
            stmt = stmt.order_by(t.trajectory_id)
        with self.engine.connect() as conn:
            rows = [dict(m) for m in conn.execute(stmt.limit(PAGE_SIZE + 1)).mappings()]
            total = int(conn.execute(select(func.count()).select_from(trajectories).where(*clauses)).scalar_one())
        more = len(rows) > PAGE_SIZE
        rows = rows[:PAGE_SIZE]
        if before is not None:
            rows.reverse()
            has_prev, has_next = more, True
        else:
            has_prev, has_next = after is not None, more
        return Page(
            rows=rows,
            total=total,
            next_after=rows[-1]["trajectory_id"] if rows and has_next else None,
            prev_before=rows[0]["trajectory_id"] if rows and has_prev else None,
        )

    def trajectory(self, trajectory_id: str) -> dict[str, Any] | None:
        """A trajectory's row, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(select(trajectories).where(trajectories.c.trajectory_id == trajectory_id)).mappings()
            found = row.first()
        return dict(found) if found else None

    def neighbours(self, trajectory_id: str) -> tuple[str | None, str | None]:
        """The ids before and after ``trajectory_id`` in list order (primary-key lookups)."""
        t = trajectories.c
        with self.engine.connect() as conn:
            prev = conn.execute(select(func.max(t.trajectory_id)).where(t.trajectory_id < trajectory_id)).scalar()
            nxt = conn.execute(select(func.min(t.trajectory_id)).where(t.trajectory_id > trajectory_id)).scalar()
        return prev, nxt

    def branches(self, trajectory_id: str) -> list[dict[str, Any]]:
        """The branches forked from a trajectory (their list columns), by branch step."""
        t = trajectories.c
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(*[t[name] for name in _LIST_COLUMNS])
                .where(t.parent_trajectory_id == trajectory_id)
                .order_by(t.branch_step, t.trajectory_id)
            ).mappings()
            return [dict(r) for r in rows]

    def group(self, group_id: str) -> Group | None:
        """A group's row, stored members and planned rollouts; None when the index knows nothing of it."""
        t, g, w = trajectories.c, rollout_groups.c, work_items.c
        with self.engine.connect() as conn:
            row = conn.execute(select(rollout_groups).where(g.group_id == group_id)).mappings().first()
            members = conn.execute(
                select(*[t[name] for name in _LIST_COLUMNS], t.started_at, t.runner_id, t.env_instance_id)
                .where(t.group_id == group_id)
                .order_by(t.rollout_index, func.coalesce(t.branch_step, 0), t.trajectory_id)
            ).mappings()
            member_rows = [dict(m) for m in members]
            planned = list(
                conn.execute(
                    select(w.rollout_index)
                    .where(w.group_id == group_id, w.parent_trajectory_id.is_(None))
                    .order_by(w.rollout_index)
                ).scalars()
            )
        if row is None and not member_rows:
            return None
        return Group(group_id, dict(row) if row else None, member_rows, [int(i) for i in planned])


def _counts(rows: Sequence[Any]) -> dict[str, int]:
    return {str(k): int(n) for k, n in sorted(rows, key=lambda r: (-int(r[1]), str(r[0])))}
