"""Weights announced by URI are fetched from the artifact store and verified (every shard of a sharded version)
before any engine loads them, and staged so that what an engine serves survives the store's retention."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from dart.policy.loading import load_policy
from dart.policy.prompt import ChatPrompt
from dart.protocol.messages import ModelVersion, Sampling
from dart.protocol.weights import WeightManifest, WeightShard, shard_files
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.engine.interface import GenerationRequest
from dart.rollout.engine.vllm_wire import safetensors_header, stage_weights, weights_header
from dart.rollout.errors import WeightFetchError
from dart.rollout.service.config import SyncConfig
from dart.rollout.service.fetch import cache_usage
from dart.rollout.service.sync import WeightSyncController, fetch_weights
from dart.runtime.store import LocalStore, S3Store, StoreConfig
from dart.train.config import PublishConfig
from dart.train.publish import WeightPublisher

pytestmark = pytest.mark.integration

PAYLOAD = b"not really safetensors, but bytes with a digest" * 1000


def _version(uri: str, sha: str, version: int = 3) -> ModelVersion:
    return ModelVersion(version=version, uri=uri, sha256=sha, created_at=0.0)


def _s3_store(s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch) -> S3Store:
    """A bucket on the test S3 server, its keys in the environment as the rollout service reads them."""
    monkeypatch.setenv("DART_S3_ACCESS_KEY", s3_server.access_key)
    monkeypatch.setenv("DART_S3_SECRET_KEY", s3_server.secret_key)
    return S3Store(
        bucket,
        endpoint=s3_server.endpoint,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        secure=False,
    )


async def test_s3_weights_are_downloaded_once_and_verified(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _s3_store(s3_server, "weights-test", monkeypatch)
    info = await asyncio.to_thread(store.put, "weights/v3/model.safetensors", PAYLOAD)
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
    assert not [p for p in (tmp_path / "other").rglob("*") if p.is_file()]  # nothing unverified is kept
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


def _perturbed(policy_state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in policy_state.items()}


def _shard_mib(state: dict[str, torch.Tensor], parts: int) -> float:
    """A shard size that splits ``state`` into at least ``parts`` shards."""
    return sum(t.numel() * t.element_size() for t in state.values()) / 2**20 / parts


@pytest.fixture(scope="module")
def policy_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    model, _ = load_policy(str(checkpoint), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


async def test_a_corrupt_or_missing_shard_is_refused_and_the_previous_version_keeps_serving(
    checkpoint: Path, policy_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """Versions published in three shards to a real store: v1 reaches the engine; v2 with one shard's bytes
    changed after publishing, and v3 with a shard deleted, are refused by the fetch, and the engine keeps
    serving v1's weights."""
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    publisher = WeightPublisher(store, config=PublishConfig(shard_mib=_shard_mib(policy_state, 3)))
    v1_state = _perturbed(policy_state, 1)
    v1 = await asyncio.to_thread(publisher.save, v1_state, 1, trainer_step=1, base_model="tiny")
    engine = await HFEngine.start(HFEngineConfig(model_path=str(checkpoint), batch_wait_s=0.0, num_threads=2))
    sync = WeightSyncController({"e": engine}, SyncConfig(cache_dir=str(tmp_path / "cache")))
    try:
        assert v1.shards >= 3 and [u.ok for u in await sync.apply(v1)] == [True]
        name = next(n for n, t in v1_state.items() if t.numel() > 1)
        assert torch.equal(engine.model.state_dict()[name], v1_state[name])

        v2 = await asyncio.to_thread(publisher.save, _perturbed(policy_state, 2), 2, trainer_step=2, base_model="tiny")
        shard = store.path(f"weights/v2/model-00002-of-{v2.shards:05d}.safetensors")
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF  # the same size, one tensor byte changed
        shard.write_bytes(bytes(data))
        with pytest.raises(WeightFetchError, match="model-00002-of-.*sha256 is"):
            await sync.apply(v2)
        v3 = await asyncio.to_thread(publisher.save, _perturbed(policy_state, 3), 3, trainer_step=3, base_model="tiny")
        store.path(f"weights/v3/model-00001-of-{v3.shards:05d}.safetensors").unlink()
        with pytest.raises(WeightFetchError, match="is not a file"):
            await sync.apply(v3)
        # An announcement the manifest does not describe (another index digest) is refused as well.
        v1_changed = v1.model_copy(update={"version": 4})
        with pytest.raises(WeightFetchError, match="the manifest describes"):
            await sync.apply(v1_changed)

        assert sync.failed_fetches == 3 and engine.version == 1 and engine.stats.weight_updates == 1
        assert torch.equal(engine.model.state_dict()[name], v1_state[name])
        result = await engine.generate(
            GenerationRequest(ChatPrompt("hi"), max_new_tokens=2, sampling=Sampling(temperature=0.0))
        )
        assert result.policy_version == 1
    finally:
        await engine.close()


async def test_a_sharded_s3_version_is_downloaded_once_and_a_bad_download_is_fetched_again(
    s3_server: Any, policy_state: dict[str, torch.Tensor], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _s3_store(s3_server, "sharded-test", monkeypatch)
    publisher = WeightPublisher(store, config=PublishConfig(shard_mib=_shard_mib(policy_state, 2)))
    # Off the event loop, as the trainer service publishes (S3 writes of a few MB take a while).
    model = await asyncio.to_thread(publisher.save, policy_state, 5, trainer_step=5, base_model="tiny")
    config = StoreConfig(uri="s3://sharded-test", endpoint=s3_server.endpoint, secure=False)
    cache = tmp_path / "cache"
    directory = await fetch_weights(model, store_config=config, cache_dir=cache)
    manifest = WeightManifest.model_validate_json(await asyncio.to_thread(store.get, "weights/v5/manifest.json"))
    names = [s.name for s in manifest.shards]
    assert directory.parent == cache and len(names) == model.shards >= 2
    assert sorted(p.name for p in directory.iterdir()) == sorted([*names, "model.safetensors.index.json"])
    for shard in manifest.shards:
        assert hashlib.sha256((directory / shard.name).read_bytes()).hexdigest() == shard.sha256
    loaded: dict[str, torch.Tensor] = {}
    for shard_file in shard_files(directory):
        loaded |= load_file(str(shard_file))
    assert set(loaded) == set(policy_state)
    # Fetched again: the verified downloads are reused.
    mtimes = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    assert await fetch_weights(model, store_config=config, cache_dir=cache) == directory
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == mtimes
    # A download damaged on disk is refused and dropped; the next fetch downloads it again.
    bad = directory / names[-1]
    bad.write_bytes(bad.read_bytes()[:-1] + b"\0")
    with pytest.raises(WeightFetchError, match="sha256 is"):
        await fetch_weights(model, store_config=config, cache_dir=cache)
    assert not bad.exists()
    assert await fetch_weights(model, store_config=config, cache_dir=cache) == directory
    assert hashlib.sha256(bad.read_bytes()).hexdigest() == manifest.shards[-1].sha256


def test_a_staged_sharded_version_outlives_its_deletion_from_the_store(
    policy_state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """The vLLM engine stages every shard and the index by hard link, and checks the headers of all shards."""
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    publisher = WeightPublisher(store, config=PublishConfig(shard_mib=_shard_mib(policy_state, 3)))
    model = publisher.save(policy_state, 7, trainer_step=7, base_model="tiny")
    published = store.path("weights/v7")
    directory = stage_weights(tmp_path / "engine" / "v7", published)
    staged = sorted(p.name for p in directory.iterdir())
    assert len(staged) == model.shards + 1 and "manifest.json" not in staged
    for name in staged:
        assert (directory / name).stat().st_ino == (published / name).stat().st_ino  # a link, not a copy
        store.delete(f"weights/v7/{name}")  # retention
    header = weights_header(directory)
    assert len(header) == len(policy_state)
    assert sum(len(safetensors_header(f)) for f in shard_files(directory)) == len(policy_state)
    # Restaged as one file over it, the directory holds only that file.
    single = tmp_path / "one.safetensors"
    save_file({"w": torch.zeros(2)}, str(single))
    assert sorted(p.name for p in stage_weights(directory, single).iterdir()) == ["model.safetensors"]


async def test_a_manifest_swapped_in_the_store_or_naming_paths_is_refused_before_any_download(
    s3_server: Any, policy_state: dict[str, torch.Tensor], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever can write the store cannot steer a fetch: the announced manifest digest is checked before a
    shard name is read, and a shard name is a plain file name even under a matching digest."""
    store = _s3_store(s3_server, "manifest-test", monkeypatch)
    publisher = WeightPublisher(store, config=PublishConfig(shard_mib=_shard_mib(policy_state, 2)))
    model = await asyncio.to_thread(publisher.save, policy_state, 6, trainer_step=6, base_model="tiny")
    assert model.manifest_sha256 is not None
    config = StoreConfig(uri="s3://manifest-test", endpoint=s3_server.endpoint, secure=False)
    cache = tmp_path / "deep" / "cache"
    doc = json.loads(await asyncio.to_thread(store.get, "weights/v6/manifest.json"))
    doc["shards"][0]["name"] = "../../escape.safetensors"
    forged = json.dumps(doc).encode()
    await asyncio.to_thread(store.put, "weights/v6/manifest.json", forged)

    with pytest.raises(WeightFetchError, match="the manifest's sha256 is"):
        await fetch_weights(model, store_config=config, cache_dir=cache)
    # Announced with the forged manifest's own digest, the name itself is refused.
    announced = model.model_copy(update={"manifest_sha256": hashlib.sha256(forged).hexdigest()})
    with pytest.raises(WeightFetchError, match=r"(?s)cannot read the manifest.*shards.0.name"):
        await fetch_weights(announced, store_config=config, cache_dir=cache)
    assert not (tmp_path / "escape.safetensors").exists() and not (tmp_path / "deep" / "escape.safetensors").exists()
    assert not cache.exists() or not any(cache.rglob("*.safetensors"))


def test_a_shard_is_named_by_a_plain_file_name() -> None:
    sha = "0" * 64
    for name in ("model-00001-of-00002.safetensors", "model.safetensors"):
        WeightShard(name=name, uri="s3://b/w", size_bytes=1, sha256=sha)
    for name in ("../x.safetensors", "a/b.safetensors", ".hidden.safetensors", "/abs.safetensors", "x.pth"):
        with pytest.raises(ValidationError):
            WeightShard(name=name, uri="s3://b/w", size_bytes=1, sha256=sha)
    with pytest.raises(ValidationError, match="manifest_sha256"):
        ModelVersion(version=1, uri="s3://b/w", sha256=sha, created_at=0.0, manifest_uri="s3://b/m.json")


async def test_the_download_cache_keeps_the_newest_versions_and_the_one_just_fetched(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _s3_store(s3_server, "cache-bound-test", monkeypatch)
    config = StoreConfig(uri="s3://cache-bound-test", endpoint=s3_server.endpoint, secure=False)
    cache = tmp_path / "cache"
    versions = {}
    for n in (1, 2, 3, 4):
        payload = PAYLOAD + bytes([n])
        info = await asyncio.to_thread(store.put, f"weights/v{n}/model.safetensors", payload)
        versions[n] = _version(info.uri, hashlib.sha256(payload).hexdigest(), version=n)
    (cache / "unrelated").mkdir(parents=True)  # not a version: left alone
    for n in (1, 2, 3):
        await fetch_weights(versions[n], store_config=config, cache_dir=cache, keep=2)
    assert sorted(p.name.split("-")[0] for p in cache.glob("v*")) == ["v2", "v3"]
    # An evaluation asks for an old version: it is kept beside the newest, the one in between goes.
    old = await fetch_weights(versions[1], store_config=config, cache_dir=cache, keep=2)
    assert old.is_file() and sorted(p.name.split("-")[0] for p in cache.glob("v*")) == ["v1", "v3"]
    await fetch_weights(versions[4], store_config=config, cache_dir=cache, keep=2)
    assert sorted(p.name.split("-")[0] for p in cache.glob("v*")) == ["v3", "v4"] and (cache / "unrelated").is_dir()
    # What the host reports of its cache: the two versions, the unrelated directory and a download in progress
    # not counted.
    (cache / ".dart-tmp-0123-v5-0123456789abcdef.safetensors").write_bytes(b"partial")
    assert cache_usage(cache) == (2, 2 * (len(PAYLOAD) + 1))
    assert cache_usage(tmp_path / "never-made") == (0, 0)
