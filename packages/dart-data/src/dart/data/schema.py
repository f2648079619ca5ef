"""The SQL index's schema and its versioned migrations (SQLite and PostgreSQL).

The schema is created and upgraded by a small in-house runner rather than alembic: the data
manager owns one database, migrations are few and linear, and running them at service start with
no extra tool keeps the embedded default (``dart run``) a single process. Each migration is a
function applied in its own transaction and recorded in ``schema_version``; a database newer
than the code is refused instead of being guessed at.

Steps are not rows: a trajectory's steps live in its blob (the trajectory JSON in the artifact
store). They are only ever read whole (to build samples or replay a pooled success), so a step
table would multiply row counts by the trajectory length for no query that needs it; the
per-trajectory aggregates that are worth querying (``num_steps``, ``mean_entropy``,
``parse_errors``) are columns of ``trajectories``.

Versions:
    1. ``trajectories``, ``rollout_groups``, ``task_stats``.
    2. ``trajectories.pooled`` (member of the experience pool) and its index.
    3. ``work_items`` (every work item this data manager emitted: what a trajectory must answer),
       ``rejected_trajectories`` (deliveries refused at ingestion, with the reason) and an index on
       ``trajectories.work_id``.
    4. Retention: ``trajectories.last_batch_seq`` (``batch`` stream sequence of the newest batch that
       carried the trajectory, its own or a pool replay), ``trajectories.pruned_at`` (its objects
       were deleted) and ``image_refs`` (the store keys of images outside its own directory that a
       stored trajectory refers to: the env service's shared screenshots). Trajectories stored
       before this version have no references recorded, so retention deletes no shared screenshot
       last written before the version was applied.
    5. Branching rollouts: ``trajectories.parent_trajectory_id`` and ``branch_step`` (a branch's parent and
       the step it forked at, indexed for the viewer's tree), ``trajectories.branch_refused``, and
       ``work_items.parent_trajectory_id`` and ``branch_step`` (what a branch must answer).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    func,
    inspect,
    select,
    text,
)

from dart.data.errors import SchemaVersionError

_ID = 512  # NonEmptyStr bound of the wire ids

metadata = MetaData()
"""The current (newest) schema, used for queries."""

schema_version = Table(
    "schema_version",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("applied_at", Float, nullable=False),
)

trajectories = Table(
    "trajectories",
    metadata,
    Column("trajectory_id", String(_ID), primary_key=True),
    Column("work_id", String(_ID), nullable=False, index=True),
    Column("task_id", String(_ID), nullable=False, index=True),
    Column("group_id", String(_ID), nullable=False, index=True),
    Column("rollout_index", Integer, nullable=False),
    Column("group_size", Integer, nullable=False),
    Column("status", String(32), nullable=False),
    Column("reward", Float, nullable=False),
    Column("success", Boolean, nullable=False),
    Column("num_steps", Integer, nullable=False),
    Column("parse_errors", Integer, nullable=False),
    Column("mean_entropy", Float, nullable=False),
    Column("min_policy_version", Integer, nullable=False),
    Column("max_policy_version", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("finished_at", Float, nullable=False),
    Column("runner_id", String(_ID)),
    Column("env_instance_id", String(_ID)),
    Column("blob_key", Text, nullable=False),
    Column("blob_uri", Text, nullable=False),
    Column("ingested_at", Float, nullable=False),
    Column("pooled", Boolean, nullable=False, server_default=text("FALSE")),
    Column("last_batch_seq", Integer),
    Column("pruned_at", Float),
    Column("parent_trajectory_id", String(_ID)),
    Column("branch_step", Integer),
    Column("branch_refused", String(64)),
    Index("ix_trajectories_pool", "task_id", "pooled"),
    Index("ix_trajectories_parent", "parent_trajectory_id"),
)

image_refs = Table(
    "image_refs",
    metadata,
    Column("trajectory_id", String(_ID), primary_key=True),
    Column("key", String(1024), primary_key=True),
    Index("ix_image_refs_key", "key"),
)

rollout_groups = Table(
    "rollout_groups",
    metadata,
    Column("group_id", String(_ID), primary_key=True),
    Column("task_id", String(_ID), nullable=False, index=True),
    Column("group_size", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("reason", String(64)),
    Column("batch_id", String(_ID)),
    Column("created_at", Float, nullable=False),
    Column("closed_at", Float),
)

work_items = Table(
    "work_items",
    metadata,
    Column("work_id", String(_ID), primary_key=True),
    Column("group_id", String(_ID), nullable=False, index=True),
    Column("task_id", String(_ID), nullable=False),
    Column("rollout_index", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("parent_trajectory_id", String(_ID)),
    Column("branch_step", Integer),
)

rejected_trajectories = Table(
    "rejected_trajectories",
    metadata,
    # The delivery's place in the trajectory stream (where the message itself stays): a redelivery of
    # a rejected message is recorded once.
    Column("stream", String(_ID), primary_key=True),
    Column("stream_seq", Integer, primary_key=True, autoincrement=False),
    Column("trajectory_id", String(_ID)),
    Column("work_id", String(_ID)),
    Column("task_id", String(_ID)),
    Column("reason", String(64), nullable=False, index=True),
    Column("detail", Text, nullable=False),
    Column("rejected_at", Float, nullable=False),
)

task_stats = Table(
    "task_stats",
    metadata,
    Column("task_id", String(_ID), primary_key=True),
    Column("attempts", Integer, nullable=False),
    Column("successes", Integer, nullable=False),
    Column("ema_success", Float, nullable=False),
    Column("recent_outcomes", Text, nullable=False),
    Column("success_lengths", Text, nullable=False),
    Column("updated_at", Float, nullable=False),
)


_ADDED_AFTER_V1 = {"pooled", "last_batch_seq", "pruned_at", "parent_trajectory_id", "branch_step", "branch_refused"}


_WORK_ADDED_AFTER_V3 = {"parent_trajectory_id", "branch_step"}


def _frozen(table: Table, metadata: MetaData, added_later: set[str], *indexes: Index) -> Table:
    """A copy of ``table`` in ``metadata`` without the columns a later version added: later edits to the
    current schema must not change what an old database is upgraded from."""
    columns = [
        Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable)
        for c in table.columns
        if c.name not in added_later
    ]
    return Table(table.name, metadata, *columns, *indexes)


def _v1(conn: Connection) -> None:
    v1 = MetaData()
    indexes = (Index("ix_trajectories_task_id", "task_id"), Index("ix_trajectories_group_id", "group_id"))
    _frozen(trajectories, v1, _ADDED_AFTER_V1, *indexes)
    rollout_groups.to_metadata(v1)
    task_stats.to_metadata(v1)
    v1.create_all(conn)


def _v2(conn: Connection) -> None:
    conn.execute(text("ALTER TABLE trajectories ADD COLUMN pooled BOOLEAN NOT NULL DEFAULT FALSE"))
    conn.execute(text("CREATE INDEX ix_trajectories_pool ON trajectories (task_id, pooled)"))


def _v3(conn: Connection) -> None:
    v3 = MetaData()
    _frozen(work_items, v3, _WORK_ADDED_AFTER_V3, Index("ix_work_items_group_id", "group_id"))
    rejected_trajectories.to_metadata(v3)
    v3.create_all(conn)
    conn.execute(text("CREATE INDEX ix_trajectories_work_id ON trajectories (work_id)"))


def _v4(conn: Connection) -> None:
    conn.execute(text("ALTER TABLE trajectories ADD COLUMN last_batch_seq INTEGER"))
    conn.execute(text("ALTER TABLE trajectories ADD COLUMN pruned_at FLOAT"))
    v4 = MetaData()
    image_refs.to_metadata(v4)
    v4.create_all(conn)


def _v5(conn: Connection) -> None:
    conn.execute(text("ALTER TABLE trajectories ADD COLUMN parent_trajectory_id VARCHAR(512)"))
    conn.execute(text("ALTER TABLE trajectories ADD COLUMN branch_step INTEGER"))
    conn.execute(text("ALTER TABLE trajectories ADD COLUMN branch_refused VARCHAR(64)"))
    conn.execute(text("CREATE INDEX ix_trajectories_parent ON trajectories (parent_trajectory_id)"))
    conn.execute(text("ALTER TABLE work_items ADD COLUMN parent_trajectory_id VARCHAR(512)"))
    conn.execute(text("ALTER TABLE work_items ADD COLUMN branch_step INTEGER"))


MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: _v1, 2: _v2, 3: _v3, 4: _v4, 5: _v5}
"""Schema version -> the migration that produces it from the previous version."""
LATEST_VERSION = max(MIGRATIONS)
_MIGRATION_LOCK = 0x64617274  # PostgreSQL advisory lock key of schema migrations ("dart")


def current_version(engine: Engine) -> int:
    """Schema version of the database; 0 for an empty one."""
    if not inspect(engine).has_table("schema_version"):
        return 0
    with engine.connect() as conn:
        return int(conn.execute(select(func.coalesce(func.max(schema_version.c.version), 0))).scalar_one())


def migrate(engine: Engine, target: int = LATEST_VERSION) -> tuple[int, int]:
    """Bring the database to ``target``, one recorded migration per transaction.

    On PostgreSQL the whole run holds an advisory lock, so services starting at once on one
    database migrate one after the other (the second finds the work done) instead of racing on
    ``CREATE TABLE``. DDL is transactional there, so a failed migration leaves no half-applied
    version. SQLite runs one writer at a time anyway; the embedded stack has one data service.

    Returns:
        The versions before and after.

    Raises:
        SchemaVersionError: The database is newer than this code.
    """
    with engine.connect() as lock:
        if engine.dialect.name == "postgresql":
            lock.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _MIGRATION_LOCK})
            lock.commit()
        try:
            return _migrate(engine, target)
        finally:
            if engine.dialect.name == "postgresql":
                lock.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _MIGRATION_LOCK})
                lock.commit()


def _migrate(engine: Engine, target: int) -> tuple[int, int]:
    schema_version.create(engine, checkfirst=True)
    before = current_version(engine)
    if before > LATEST_VERSION:
        raise SchemaVersionError(before, LATEST_VERSION)
    for version in range(before + 1, target + 1):
        with engine.begin() as conn:
            MIGRATIONS[version](conn)
            conn.execute(schema_version.insert().values(version=version, applied_at=time.time()))
    return before, max(before, target)
