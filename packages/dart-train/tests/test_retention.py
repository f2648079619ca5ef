"""Retention of published weights and checkpoints, on a real local artifact store."""

from __future__ import annotations

from pathlib import Path

import pytest

from dart.runtime.store import LocalStore
from dart.train.config import RetentionConfig, TrainerConfig
from dart.train.retention import prune_checkpoints, prune_weights, published_versions, versions_to_delete

pytestmark = pytest.mark.unit


def test_keeps_the_newest_and_every_nth() -> None:
    retention = RetentionConfig(keep_last=3, keep_every=5)
    assert versions_to_delete(list(range(1, 13)), 12, retention) == [1, 2, 3, 4, 6, 7, 8, 9]
    assert versions_to_delete([1, 2], 2, retention) == []
    assert versions_to_delete(list(range(1, 8)), 7, RetentionConfig(keep_last=2, keep_every=None)) == [1, 2, 3, 4, 5]


def test_keep_last_below_two_is_refused() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        TrainerConfig.model_validate({"retention": {"keep_last": 1}})


def test_prune_deletes_whole_versions_and_nothing_else(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    for v in range(1, 8):
        store.put(f"weights/v{v}/model.safetensors", b"w" * v)
        store.put(f"weights/v{v}/manifest.json", b"{}")
    store.put("weights-other/v1/model.safetensors", b"x")
    store.put("trajectories/t/trajectory-a.json", b"{}")
    deleted = prune_weights(store, "weights", 7, RetentionConfig(keep_last=2, keep_every=3))
    assert deleted == [1, 2, 4, 5]
    assert published_versions(store, "weights") == [3, 6, 7]
    assert store.exists("weights/v6/manifest.json") and not store.exists("weights/v5/manifest.json")
    assert store.exists("weights-other/v1/model.safetensors") and store.exists("trajectories/t/trajectory-a.json")
    assert prune_weights(store, "weights", 7, RetentionConfig(keep_last=2, keep_every=3)) == []  # idempotent


def test_prune_checkpoints_keeps_the_newest_steps(tmp_path: Path) -> None:
    for step in (2, 10, 4, 8):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "state.pt").write_bytes(b"s")
    (tmp_path / "notes").mkdir()
    deleted = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in deleted) == ["step-2", "step-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-10", "step-8"]
