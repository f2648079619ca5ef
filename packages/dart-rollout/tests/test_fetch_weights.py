"""Weights announced by URI are fetched from the artifact store and verified before any engine loads them, and
staged so that what an engine serves survives the store's retention."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from dart.protocol.messages import ModelVersion
from dart.protocol.store import S3Store, StoreConfig
from dart.rollout.engine.vllm_wire import stage_weights
from dart.rollout.errors import WeightFetchError
from dart.rollout.service.sync import fetch_weights

pytestmark = pytest.mark.integration

PAYLOAD = b"not really safetensors, but bytes with a digest" * 1000


def _version(uri: str, sha: str, version: int = 3) -> ModelVersion:
    return ModelVersion(version=version, uri=uri, sha256=sha, created_at=0.0)


async def test_s3_weights_are_downloaded_once_and_verified(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DART_S3_ACCESS_KEY", s3_server.access_key)
    monkeypatch.setenv("DART_S3_SECRET_KEY", s3_server.secret_key)
    store = S3Store(
        "weights-test",
        endpoint=s3_server.endpoint,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        secure=False,
    )
    info = store.put("weights/v3/model.safetensors", PAYLOAD)
    config = StoreConfig(uri="s3://weights-test", endpoint=s3_server.endpoint, secure=False)
    sha = hashlib.sha256(PAYLOAD).hexdigest()
    path = await fetch_weights(_version(info.uri, sha), store_config=config, cache_dir=tmp_path)
    assert path.read_bytes() == PAYLOAD and path.parent == tmp_path
    # A second fetch of the same version reuses the verified download.
    mtime = path.stat().st_mtime_ns
    assert await fetch_weights(_version(info.uri, sha), store_config=config, cache_dir=tmp_path) == path
    assert path.stat().st_mtime_ns == mtime
    with pytest.raises(WeightFetchError, match="sha256"):
        await fetch_weights(_version(info.uri, "0" * 64), store_config=config, cache_dir=tmp_path / "other")
    with pytest.raises(WeightFetchError):
        await fetch_weights(
            _version("s3://weights-test/weights/v9/none.safetensors", sha, 9), store_config=config, cache_dir=tmp_path
        )


async def test_unsupported_scheme_is_refused() -> None:
    with pytest.raises(WeightFetchError, match="file:// or s3://"):
        await fetch_weights(_version("http://example.invalid/w.safetensors", "0" * 64))


def test_staged_weights_outlive_their_deletion_from_the_store(tmp_path: Path) -> None:
    """A vLLM engine stages what it loads: the store's retention deleting the version afterwards (seen in a
    run: the server's reload then failed on a dangling link and its engine core died) changes nothing."""
    published = tmp_path / "artifacts" / "weights" / "v11" / "model.safetensors"
    published.parent.mkdir(parents=True)
    published.write_bytes(PAYLOAD)
    directory = stage_weights(tmp_path / "engine" / "v11", published)
    published.unlink()  # retention
    staged = directory / "model.safetensors"
    assert not staged.is_symlink() and staged.read_bytes() == PAYLOAD
    # A source already gone when staging starts is an OSError, which the engine reports as a failed update.
    with pytest.raises(FileNotFoundError):
        stage_weights(tmp_path / "engine" / "v12", published)
