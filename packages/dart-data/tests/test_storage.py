from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from dart.data.batches import group_samples
from dart.data.blobs import TrajectoryBlobs
from dart.data.config import BatchingConfig
from dart.data.errors import SchemaVersionError
from dart.data.groups import ReadyGroup
from dart.data.index import TrajectoryIndex, trajectory_row
from dart.data.schema import LATEST_VERSION, current_version, migrate
from dart.data.stats import TaskStats
from dart.protocol import messages as m
from dart.runtime.store import LocalStore

pytestmark = pytest.mark.unit


def test_v1_database_is_upgraded_with_its_data(database_url: str) -> None:
    url = database_url
    engine = create_engine(url)
    assert migrate(engine, target=1) == (0, 1)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO trajectories (trajectory_id, work_id, task_id, group_id, rollout_index, group_size,"
                " status, reward, success, num_steps, parse_errors, mean_entropy, min_policy_version,"
                " max_policy_version, started_at, finished_at, blob_key, blob_uri, ingested_at)"
                " VALUES ('t1', 'w1', 'task', 'g', 0, 2, 'ok', 1.0, TRUE, 2, 0, 0.5, 1, 1, 0, 1, 'k', 'file:///k', 0)"
            )
        )
    assert "pooled" not in {c["name"] for c in inspect(engine).get_columns("trajectories")}
    engine.dispose()

    index = TrajectoryIndex(url)
    assert index.migrate() == (1, LATEST_VERSION)
    assert index.migrate() == (LATEST_VERSION, LATEST_VERSION)  # idempotent
    row = index.trajectory("t1")
    assert row is not None and row["pooled"] is False and row["reward"] == 1.0
    assert index.add_to_pool("t1", "task", keep=2) == []
    assert [e.trajectory_id for e in index.pool()] == ["t1"]
    index.close()


def test_newer_schema_is_refused(database_url: str) -> None:
    engine = create_engine(database_url)
    migrate(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO schema_version (version, applied_at) VALUES (99, 0)"))
    assert current_version(engine) == 99
    with pytest.raises(SchemaVersionError, match="newer") as info:
        migrate(engine)
    assert (info.value.found, info.value.supported) == (99, LATEST_VERSION)
    engine.dispose()


def test_ingestion_is_idempotent(tmp_path: Path, database_url: str, traj_factory) -> None:  # type: ignore[no-untyped-def]
    store = LocalStore(tmp_path / "store")
    blobs = TrajectoryBlobs(store)
    index = TrajectoryIndex(database_url)
    index.migrate()
    traj = traj_factory("t-1", reward=1.0, steps=3)
    assert all(isinstance(s.prompt_images[0], m.InlineImage) for s in traj.steps)
    first = blobs.put(traj)
    second = blobs.put(traj)
    assert first == second  # same keys, same JSON
    keys = sorted(info.key for info in store.list("trajectories/t-1/"))
    assert len(keys) == 4  # three distinct screenshots and the JSON
    assert first.blob_key.startswith("trajectories/t-1/trajectory-")
    for step in first.trajectory.steps:
        shot = step.observation.screenshot
        assert isinstance(shot, m.ImageRef) and shot.uri.startswith("file://")
        assert step.prompt_images == [shot]  # the fed image is the screenshot: one blob, one reference
    samples = group_samples(ReadyGroup("g", [first.trajectory], complete=True), BatchingConfig())
    assert [s.images for s in samples] == [step.prompt_images for step in first.trajectory.steps]
    with pytest.raises(ValueError, match="stored references"):
        group_samples(ReadyGroup("g", [traj], complete=True), BatchingConfig())
    assert blobs.get(first.blob_key) == first.trajectory

    stats = TaskStats(traj.task.task_id).recorded(True, 3, window=8)
    assert index.store_trajectory(trajectory_row(first), stats) is True
    assert index.store_trajectory(trajectory_row(second), stats.recorded(True, 3, window=8)) is False
    assert index.count_trajectories() == 1
    assert index.task_stats()[traj.task.task_id].attempts == 1  # the duplicate changed nothing
    row = index.trajectory("t-1")
    assert row is not None and row["num_steps"] == 3 and row["blob_uri"] == first.blob_uri and row["success"]

    index.record_group("g", "task", 2, "open")
    index.record_group("g", "task", 2, "emitted", batch_id="b-1")
    group = index.group("g")
    assert group is not None and (group["status"], group["batch_id"]) == ("emitted", "b-1")
    assert group["closed_at"] is not None
    index.close()


def test_unsafe_ids_get_hashed_keys(tmp_path: Path, traj_factory) -> None:  # type: ignore[no-untyped-def]
    blobs = TrajectoryBlobs(LocalStore(tmp_path / "store"), prefix="trajs")
    stored = blobs.put(traj_factory("../evil/id"))
    assert stored.blob_key.startswith("trajs/h-") and ".." not in stored.blob_key


def test_pool_keeps_newest_per_task(tmp_path: Path, database_url: str, traj_factory) -> None:  # type: ignore[no-untyped-def]
    blobs = TrajectoryBlobs(LocalStore(tmp_path / "store"))
    index = TrajectoryIndex(database_url)
    index.migrate()
    for i in range(3):
        index.store_trajectory(trajectory_row(blobs.put(traj_factory(f"w{i}", idx=i, reward=1.0))), None)
    assert index.add_to_pool("w0", "sim/click/1", keep=2) == []
    assert index.add_to_pool("w1", "sim/click/1", keep=2) == []
    assert index.add_to_pool("w2", "sim/click/1", keep=2) == ["w0"]  # the oldest leaves
    assert [e.trajectory_id for e in index.pool()] == ["w2", "w1"]
    index.close()


def test_concurrent_migrations_apply_each_version_once(postgres_url: str) -> None:
    """Two services starting at once on one PostgreSQL database: one migrates, the other waits."""
    engines = [create_engine(postgres_url) for _ in range(4)]
    with ThreadPoolExecutor(len(engines)) as pool:
        results = list(pool.map(migrate, engines))
    assert sorted(after for _, after in results) == [LATEST_VERSION] * len(engines)
    assert sorted(before for before, _ in results)[0] == 0
    with engines[0].connect() as conn:
        versions = conn.execute(text("SELECT version FROM schema_version ORDER BY version")).scalars().all()
    assert versions == list(range(1, LATEST_VERSION + 1))
    for engine in engines:
        engine.dispose()


def test_screenshots_upload_concurrently_and_bounded(tmp_path: Path, traj_factory) -> None:  # type: ignore[no-untyped-def]
    """Every distinct screenshot is stored before the JSON that refers to it, on a bounded pool."""
    store = LocalStore(tmp_path / "store")
    blobs = TrajectoryBlobs(store, upload_concurrency=3)
    traj = traj_factory("t-c", steps=7)
    stored = blobs.put(traj)
    threads = {t.name for t in threading.enumerate() if t.name.startswith("dart-blob-upload")}
    assert 1 <= len(threads) <= 3
    refs = [s.observation.screenshot for s in stored.trajectory.steps]
    assert all(isinstance(r, m.ImageRef) and store.exists(r.uri.rsplit("/store/", 1)[1]) for r in refs)
    assert blobs.put(traj) == stored  # idempotent with concurrent uploads too
    blobs.close()
    blobs.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("dart-blob-upload")]
    with pytest.raises(ValueError, match="upload_concurrency"):
        TrajectoryBlobs(store, upload_concurrency=0)
