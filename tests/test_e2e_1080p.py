"""End to end at 1920x1080 with artifacts on S3: `dart run examples/smoke-1080p.yaml` with
`run.artifacts: embedded_s3` completes with nothing lost; its screenshots travel by reference through
the S3 store, each stored step records the images its prompt was fed, and a plain S3 client lists and
reads the run's weights and trajectories with the layout docs/storage.md gives."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from minio import Minio

from dart.embedded.s3 import EmbeddedS3
from dart.protocol.messages import ImageRef, Trajectory

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_1080p(smoke_run: tuple[dict[str, Any], Path]) -> tuple[dict[str, Any], Path]:
    """The session's smoke run (root conftest): this one, shared with tests/test_e2e_run.py."""
    return smoke_run


@pytest.fixture(scope="module")
def s3_client(run_1080p: tuple[dict[str, Any], Path]) -> Iterator[Minio]:
    """A plain S3 client on the run's store: the server stopped with the run and its data stayed in
    <run_dir>/s3; it is served again here, with new keys."""
    _, run_dir = run_1080p
    with EmbeddedS3(data_dir=run_dir / "s3") as s3:
        yield Minio(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key, secure=False)


def _read(client: Minio, key: str) -> bytes:
    response = client.get_object("dart", key)
    try:
        return bytes(response.read())
    finally:
        response.close()
        response.release_conn()


def test_a_1080p_run_completes_with_nothing_lost(run_1080p: tuple[dict[str, Any], Path]) -> None:
    summary, run_dir = run_1080p
    assert summary["error"] is None
    assert summary["versions_published"] >= 2
    assert summary["trajectories_produced"] > 0
    assert summary["trajectories_produced"] == summary["trajectories_stored"]
    assert summary["trajectories_lost"] == 0
    assert summary["service_exit_codes"] == {"rollout": 0, "data": 0, "train": 0, "env": 0}
    # Screenshots by reference keep trajectories small: far below the bus's 8 MiB limit.
    assert 0 < summary["largest_trajectory_message_bytes"] < 1024 * 1024
    assert summary["store_uri"] == "s3://dart/artifacts"
    assert summary["store_bytes"] > 0 and summary["store_objects"] > 0
    by_kind = summary["store_bytes_by_kind"]
    assert sum(by_kind.values()) == summary["store_bytes"] and by_kind["weights"] == summary["store_weights_bytes"]
    assert not (run_dir / "artifacts").exists()  # nothing went to the local store
    # Version 0 and the final version were evaluated on the whole held-out split, at 1080p too.
    assert [(h["version"], h["n"]) for h in summary["heldout"]] == [(0, 32), (summary["versions_published"], 32)]


def test_a_plain_s3_client_reads_the_runs_weights_and_trajectories(
    run_1080p: tuple[dict[str, Any], Path], s3_client: Minio
) -> None:
    summary, _ = run_1080p
    objects = list(s3_client.list_objects("dart", prefix="artifacts/", recursive=True))
    keys = [o.object_name for o in objects]
    trajectories = [k for k in keys if k and k.startswith("artifacts/trajectories/") and k.endswith(".json")]
    manifests = sorted(k for k in keys if k and k.startswith("artifacts/weights/v") and k.endswith("/manifest.json"))
    assert trajectories and manifests, keys[:20]
    assert sum(o.size or 0 for o in objects) == summary["store_bytes"]
    manifest = json.loads(_read(s3_client, manifests[-1]))
    assert manifest["weights_uri"].startswith("s3://dart/artifacts/weights/v")
    assert manifest["weights_uri"].removeprefix("s3://dart/") in keys


def test_screenshots_went_by_reference_and_steps_record_what_was_fed(s3_client: Minio) -> None:
    keys = {o.object_name for o in s3_client.list_objects("dart", prefix="artifacts/", recursive=True) if o.object_name}
    assert any(k.startswith("artifacts/screenshots/") and k.endswith(".png") for k in keys), (
        "the env service stored no screenshot by reference"
    )
    first = min(k for k in keys if k.startswith("artifacts/trajectories/") and "/trajectory-" in k)
    trajectory = Trajectory.model_validate_json(_read(s3_client, first))
    steps = [s for s in trajectory.steps if s.response_token_ids]
    assert steps
    for step in steps:
        shot = step.observation.screenshot
        assert isinstance(shot, ImageRef) and (shot.width, shot.height) == (1920, 1080)
        # Stored once by the env service, not re-uploaded by dart-data.
        assert shot.uri.startswith("s3://dart/artifacts/screenshots/") and shot.uri.removeprefix("s3://dart/") in keys
        assert len(step.prompt_images) == 1  # max_images: 1
        # The fed (resized) image went by reference from the rollout, beside the env's screenshots.
        fed = step.prompt_images[0]
        assert isinstance(fed, ImageRef) and (fed.width, fed.height) == (224, 224)
        assert fed.uri.startswith("s3://dart/artifacts/screenshots/") and fed.uri.removeprefix("s3://dart/") in keys


def test_retention_deleted_what_training_was_done_with_and_nothing_still_referenced(
    run_1080p: tuple[dict[str, Any], Path], s3_client: Minio
) -> None:
    """smoke-1080p keeps one version and sweeps every 2 s: trajectories were pruned during the run; every
    trajectory still stored is whole (its JSON and every image it refers to are there), every pruned one is
    gone, and every index row is still there."""
    summary, run_dir = run_1080p
    # The rollout host's weight cache (the run's own, <run_dir>/weights) keeps rollout.sync.keep_versions (2).
    (cache,) = summary["weight_cache"].values()
    on_disk = [p for p in (run_dir / "weights").iterdir() if not p.name.startswith(".dart-tmp-")]
    assert 1 <= cache["versions"] <= 2 and cache["bytes"] > 0 and 1 <= len(on_disk) <= 2, (cache, on_disk)
    deleted = summary["retention_deleted"]
    assert deleted["trajectories"] > 0 and deleted["objects"] >= deleted["trajectories"] and deleted["bytes"] > 0
    keys = {o.object_name for o in s3_client.list_objects("dart", prefix="artifacts/", recursive=True)}
    with sqlite3.connect(run_dir / "data.sqlite3") as db:
        rows = db.execute("SELECT trajectory_id, blob_key, pruned_at FROM trajectories").fetchall()
    assert len(rows) == summary["trajectories_stored"]
    pruned = [(tid, key) for tid, key, at in rows if at is not None]
    kept = [(tid, key) for tid, key, at in rows if at is None]
    assert len(pruned) == deleted["trajectories"] and kept
    for tid, blob_key in pruned:
        directory = "artifacts/" + blob_key.rsplit("/", 1)[0] + "/"
        assert not any(k and k.startswith(directory) for k in keys), tid
    for _, blob_key in kept:
        assert f"artifacts/{blob_key}" in keys
        trajectory = Trajectory.model_validate_json(_read(s3_client, f"artifacts/{blob_key}"))
        for step in trajectory.steps:
            for image in (step.observation.screenshot, *step.prompt_images):
                assert isinstance(image, ImageRef) and image.uri.removeprefix("s3://dart/") in keys, image.uri
