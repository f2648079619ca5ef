from __future__ import annotations

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
from dart.protocol.store import LocalStore

pytestmark = pytest.mark.unit


def test_v1_database_is_upgraded_with_its_data(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'data.sqlite3'}"
    engine = create_engine(url)
    assert migrate(engine, target=1) == (0, 1)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO trajectories (trajectory_id, work_id, task_id, group_id, rollout_index, group_size,"
                " status, reward, success, num_steps, parse_errors, mean_entropy, min_policy_version,"
                " max_policy_version, started_at, finished_at, blob_key, blob_uri, ingested_at)"
                " VALUES ('t1', 'w1', 'task', 'g', 0, 2, 'ok', 1.0, 1, 2, 0, 0.5, 1, 1, 0, 1, 'k', 'file:///k', 0)"
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


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'data.sqlite3'}")
    migrate(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO schema_version (version, applied_at) VALUES (99, 0)"))
    assert current_version(engine) == 99
    with pytest.raises(SchemaVersionError, match="newer") as info:
        migrate(engine)
    assert (info.value.found, info.value.supported) == (99, LATEST_VERSION)


def test_ingestion_is_idempotent(tmp_path: Path, traj_factory) -> None:  # type: ignore[no-untyped-def]
    store = LocalStore(tmp_path / "store")
    blobs = TrajectoryBlobs(store)
    index = TrajectoryIndex(f"sqlite:///{tmp_path / 'data.sqlite3'}")
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


def test_pool_keeps_newest_per_task(tmp_path: Path, traj_factory) -> None:  # type: ignore[no-untyped-def]
    blobs = TrajectoryBlobs(LocalStore(tmp_path / "store"))
    index = TrajectoryIndex(f"sqlite:///{tmp_path / 'data.sqlite3'}")
    index.migrate()
    for i in range(3):
        index.store_trajectory(trajectory_row(blobs.put(traj_factory(f"w{i}", idx=i, reward=1.0))), None)
    assert index.add_to_pool("w0", "sim/click/1", keep=2) == []
    assert index.add_to_pool("w1", "sim/click/1", keep=2) == []
    assert index.add_to_pool("w2", "sim/click/1", keep=2) == ["w0"]  # the oldest leaves
    assert [e.trajectory_id for e in index.pool()] == ["w2", "w1"]
    index.close()
