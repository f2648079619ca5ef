"""The SQL index of trajectories, groups and task statistics (synchronous; call from a thread).

Group lifecycle as recorded in ``rollout_groups``: ``open`` when its work is emitted (or its
first trajectory arrives, for work emitted elsewhere) -> ``emitted`` (in a training batch,
``batch_id`` set) or ``dropped`` (``reason``: ``too_small``, ``zero_variance``, ``no_samples``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, and_, create_engine, delete, event, func, insert, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from dart.data.blobs import StoredTrajectory
from dart.data.schema import (
    image_refs,
    migrate,
    rejected_trajectories,
    rollout_groups,
    schema_version,
    task_stats,
    trajectories,
    work_items,
)
from dart.data.stats import TaskStats
from dart.protocol.messages import WorkItem


@dataclass(frozen=True)
class PoolEntry:
    """A pooled successful trajectory: where its blob is."""

    task_id: str
    trajectory_id: str
    blob_key: str


class TrajectoryIndex:
    """The data manager's SQL database.

    Not safe for concurrent writers: the service serializes every call on one worker thread,
    which also keeps SQLite free of lock contention.
    """

    def __init__(self, url: str) -> None:
        """Refer to (not yet open or migrate) the database at SQLAlchemy ``url``."""
        self.url = url
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine, created on first use.

        Lazily, because creating it imports the driver (psycopg takes over a second to import on
        a busy machine): the service's first use is on its database thread, not its event loop.
        """
        if self._engine is None:
            engine = create_engine(self.url)
            if engine.dialect.name == "sqlite":
                event.listen(engine, "connect", _sqlite_pragmas)
            self._engine = engine
        return self._engine

    def migrate(self) -> tuple[int, int]:
        """Create or upgrade the schema; returns the versions before and after."""
        return migrate(self.engine)

    def close(self) -> None:
        """Release pooled connections."""
        if self._engine is not None:
            self._engine.dispose()

    def store_trajectory(self, row: Mapping[str, Any], stats: TaskStats | None, image_keys: Sequence[str] = ()) -> bool:
        """Insert a trajectory row once; on first insert also save the task's new statistics and
        the store keys of the shared images it refers to (``image_keys``, see :mod:`dart.data.retention`).

        All happen in one transaction, so a redelivered trajectory never counts twice.

        Returns:
            True when the row was new, False for a duplicate (nothing changed).
        """
        with self.engine.begin() as conn:
            stmt = self._insert(trajectories).values(**row, ingested_at=time.time())
            # RETURNING, not rowcount: SQLAlchemy reports rowcount -1 for psycopg inserts.
            stmt = stmt.on_conflict_do_nothing(index_elements=["trajectory_id"]).returning(trajectories.c.trajectory_id)
            inserted = conn.execute(stmt).first() is not None
            if inserted and stats is not None:
                self._save_stats(conn, stats)
            if inserted and image_keys:
                refs = [{"trajectory_id": row["trajectory_id"], "key": k} for k in sorted(set(image_keys))]
                conn.execute(insert(image_refs).values(refs))
            return inserted

    def record_group(
        self,
        group_id: str,
        task_id: str,
        group_size: int,
        status: str,
        *,
        reason: str | None = None,
        batch_id: str | None = None,
    ) -> None:
        """Create or update a group's row (``open``, ``emitted`` or ``dropped``)."""
        with self.engine.begin() as conn:
            _put_group(conn, group_id, task_id, group_size, status, reason=reason, batch_id=batch_id)

    def record_batch(
        self, batch_id: str, batch_seq: int, groups: Sequence[tuple[str, str, int]], trajectory_ids: Sequence[str]
    ) -> None:
        """Record a published batch in one transaction: its groups ``emitted`` and, on every trajectory it
        carries (its groups' own and pool replays), the batch's stream sequence as ``last_batch_seq``.

        Args:
            batch_id: The batch.
            batch_seq: Its sequence in the ``batch`` stream (what the trainer's ack floor is compared with).
            groups: ``(group_id, task_id, members)`` of each group in the batch.
            trajectory_ids: Every trajectory whose samples the batch holds.
        """
        t = trajectories.c
        with self.engine.begin() as conn:
            for group_id, task_id, members in groups:
                _put_group(conn, group_id, task_id, members, "emitted", batch_id=batch_id)
            newer = or_(t.last_batch_seq.is_(None), t.last_batch_seq < batch_seq)
            conn.execute(
                update(trajectories)
                .where(t.trajectory_id.in_(list(trajectory_ids)), newer)
                .values(last_batch_seq=batch_seq)
            )

    def prunable(self, ack_floor: int, below_version: int, keep_every: int | None, limit: int) -> list[str]:
        """Trajectories whose objects retention may delete, oldest first (see :mod:`dart.data.retention`).

        Args:
            ack_floor: The trainer's ack floor in the ``batch`` stream: every batch at or below it is done.
            below_version: Only trajectories whose newest step's version is below this.
            keep_every: Keep trajectories whose newest step's version is divisible by this.
            limit: Most ids returned.
        """
        t, g = trajectories.c, rollout_groups.c
        done = or_(
            and_(t.last_batch_seq.is_(None), g.status == "dropped"),
            t.last_batch_seq <= ack_floor,
        )
        stmt = (
            select(t.trajectory_id)
            .join(rollout_groups, g.group_id == t.group_id)
            .where(t.pruned_at.is_(None), t.pooled.is_(False), t.max_policy_version < below_version)
            .where(g.status != "open", done)
            .order_by(t.ingested_at)
            .limit(limit)
        )
        if keep_every:
            stmt = stmt.where(t.max_policy_version % keep_every != 0)
        with self.engine.connect() as conn:
            return list(conn.execute(stmt).scalars())

    def mark_pruned(self, trajectory_ids: Sequence[str]) -> None:
        """Record trajectories' objects deleted: ``pruned_at`` set, their image references dropped."""
        ids = list(trajectory_ids)
        with self.engine.begin() as conn:
            conn.execute(
                update(trajectories).where(trajectories.c.trajectory_id.in_(ids)).values(pruned_at=time.time())
            )
            conn.execute(delete(image_refs).where(image_refs.c.trajectory_id.in_(ids)))

    def referenced(self, keys: Iterable[str]) -> set[str]:
        """Those of ``keys`` that a stored, unpruned trajectory refers to (shared images)."""
        wanted = list(keys)
        found: set[str] = set()
        with self.engine.connect() as conn:
            for i in range(0, len(wanted), 500):
                chunk = wanted[i : i + 500]
                found.update(
                    conn.execute(select(image_refs.c.key).where(image_refs.c.key.in_(chunk)).distinct()).scalars()
                )
        return found

    def references_since(self) -> float:
        """Unix time from which every stored trajectory's shared-image references are recorded
        (when schema version 4 was applied)."""
        v = schema_version.c
        with self.engine.connect() as conn:
            return float(conn.execute(select(v.applied_at).where(v.version == 4)).scalar_one())

    def pruned_count(self) -> int:
        """Trajectories whose objects retention deleted."""
        t = trajectories.c
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(trajectories).where(t.pruned_at.is_not(None))
                ).scalar_one()
            )

    def record_work(self, items: Sequence[WorkItem]) -> None:
        """Record one group ``open`` and its work items (before they are published), in one transaction.

        A group or work item already recorded (a retried emission) is left as it is.
        """
        head, now = items[0], time.time()
        group = {
            "group_id": head.group_id,
            "task_id": head.task.task_id,
            "group_size": len(items),
            "status": "open",
            "created_at": now,
        }
        with self.engine.begin() as conn:
            conn.execute(
                self._insert(rollout_groups).values(**group).on_conflict_do_nothing(index_elements=["group_id"])
            )
            rows = [
                {
                    "work_id": w.work_id,
                    "group_id": w.group_id,
                    "task_id": w.task.task_id,
                    "rollout_index": w.rollout_index,
                    "created_at": now,
                    "parent_trajectory_id": w.branch.parent_trajectory_id if w.branch is not None else None,
                    "branch_step": w.branch.step_index if w.branch is not None else None,
                }
                for w in items
            ]
            conn.execute(self._insert(work_items).values(rows).on_conflict_do_nothing(index_elements=["work_id"]))

    def work_item(self, work_id: str) -> dict[str, Any] | None:
        """An emitted work item's row, or None when this data manager never emitted it."""
        with self.engine.connect() as conn:
            row = conn.execute(select(work_items).where(work_items.c.work_id == work_id)).mappings().first()
        return dict(row) if row else None

    def trajectory_ids_of_work(self, work_id: str) -> list[str]:
        """Ids of the stored trajectories answering one work item (at most one once ingestion checks)."""
        t = trajectories.c
        with self.engine.connect() as conn:
            return list(conn.execute(select(t.trajectory_id).where(t.work_id == work_id)).scalars())

    def record_rejection(
        self,
        stream: str,
        stream_seq: int,
        reason: str,
        detail: str,
        *,
        trajectory_id: str | None = None,
        work_id: str | None = None,
        task_id: str | None = None,
    ) -> bool:
        """Record a delivery refused at ingestion, once per stream message.

        Returns:
            True when it was new, False for a redelivery of a message already recorded.
        """
        values = {
            "stream": stream,
            "stream_seq": stream_seq,
            "reason": reason,
            "detail": detail,
            "trajectory_id": trajectory_id,
            "work_id": work_id,
            "task_id": task_id,
            "rejected_at": time.time(),
        }
        stmt = self._insert(rejected_trajectories).values(**values)
        stmt = stmt.on_conflict_do_nothing(index_elements=["stream", "stream_seq"]).returning(
            rejected_trajectories.c.stream_seq
        )
        with self.engine.begin() as conn:
            return conn.execute(stmt).first() is not None

    def rejections(self) -> Counter[str]:
        """Deliveries refused at ingestion, by reason."""
        r = rejected_trajectories.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(r.reason, func.count()).group_by(r.reason)).all()
        return Counter({reason: int(n) for reason, n in rows})

    def group(self, group_id: str) -> dict[str, Any] | None:
        """A group's row, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(select(rollout_groups).where(rollout_groups.c.group_id == group_id)).mappings().first()
        return dict(row) if row else None

    def trajectory(self, trajectory_id: str) -> dict[str, Any] | None:
        """A trajectory's row, or None."""
        with self.engine.connect() as conn:
            stmt = select(trajectories).where(trajectories.c.trajectory_id == trajectory_id)
            row = conn.execute(stmt).mappings().first()
        return dict(row) if row else None

    def count_trajectories(self) -> int:
        """Stored trajectories."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(trajectories)).scalar_one())

    def task_stats(self) -> dict[str, TaskStats]:
        """Every task's statistics."""
        with self.engine.connect() as conn:
            return {r["task_id"]: TaskStats.from_row(dict(r)) for r in conn.execute(select(task_stats)).mappings()}

    def add_to_pool(self, trajectory_id: str, task_id: str, keep: int) -> list[str]:
        """Mark a trajectory pooled and unpool the task's oldest beyond ``keep``.

        Returns:
            Ids of trajectories that left the pool.
        """
        t = trajectories.c
        with self.engine.begin() as conn:
            conn.execute(update(trajectories).where(t.trajectory_id == trajectory_id).values(pooled=True))
            pooled = conn.execute(
                select(t.trajectory_id).where(t.task_id == task_id, t.pooled).order_by(t.finished_at.desc())
            ).scalars()
            evicted = list(pooled)[keep:]
            if evicted:
                conn.execute(update(trajectories).where(t.trajectory_id.in_(evicted)).values(pooled=False))
        return evicted

    def pool(self) -> list[PoolEntry]:
        """Every pooled trajectory, newest first."""
        t = trajectories.c
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(t.task_id, t.trajectory_id, t.blob_key).where(t.pooled).order_by(t.finished_at.desc())
            ).all()
        return [PoolEntry(r.task_id, r.trajectory_id, r.blob_key) for r in rows]

    def _insert(self, table: Any) -> Any:
        # ON CONFLICT DO NOTHING is dialect syntax; both supported dialects spell it the same way.
        dialect = postgresql if self.engine.dialect.name == "postgresql" else sqlite
        return dialect.insert(table)

    def _save_stats(self, conn: Connection, stats: TaskStats) -> None:
        values = {**stats.to_row(), "updated_at": time.time()}
        stmt = self._insert(task_stats).values(**values)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["task_id"], set_={k: v for k, v in values.items() if k != "task_id"}
            )
        )


def _put_group(
    conn: Connection,
    group_id: str,
    task_id: str,
    group_size: int,
    status: str,
    *,
    reason: str | None = None,
    batch_id: str | None = None,
) -> None:
    """Create or update a group's row within ``conn``'s transaction."""
    now = time.time()
    values = {"status": status, "reason": reason, "batch_id": batch_id, "closed_at": None if status == "open" else now}
    g = rollout_groups.c
    if conn.execute(update(rollout_groups).where(g.group_id == group_id).values(**values)).rowcount == 0:
        conn.execute(
            insert(rollout_groups).values(
                group_id=group_id, task_id=task_id, group_size=group_size, created_at=now, **values
            )
        )


def trajectory_row(stored: StoredTrajectory) -> dict[str, Any]:
    """Column values of a stored trajectory's ``trajectories`` row (without ``ingested_at``)."""
    t = stored.trajectory
    entropies = [e for s in t.steps for e in s.response_entropy]
    return {
        "trajectory_id": t.trajectory_id,
        "work_id": t.work_id,
        "task_id": t.task.task_id,
        "group_id": t.group_id,
        "rollout_index": t.rollout_index,
        "group_size": t.group_size,
        "status": t.status.value,
        "reward": t.reward,
        "success": t.success,
        "num_steps": len(t.steps),
        "parse_errors": sum(s.parse_error is not None for s in t.steps),
        "mean_entropy": sum(entropies) / len(entropies) if entropies else 0.0,
        "min_policy_version": t.min_policy_version,
        "max_policy_version": t.max_policy_version,
        "started_at": t.started_at,
        "finished_at": t.finished_at,
        "runner_id": t.runner_id,
        "env_instance_id": t.env_instance_id,
        "blob_key": stored.blob_key,
        "blob_uri": stored.blob_uri,
        "parent_trajectory_id": t.branch.parent_trajectory_id if t.branch is not None else None,
        "branch_step": t.branch.step_index if t.branch is not None else None,
        "branch_refused": t.branch_refused,
    }


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (a report, a second process) look while the service writes.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()
