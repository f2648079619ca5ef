"""Fetching a published weight version for the engines: the one place that resolves weight URIs.

A one-shard version is a single safetensors file: its ``file://`` path is used in place, an ``s3://`` one
is downloaded into the cache directory once per host; either way its sha256 is checked against the
announcement. A sharded version (``ModelVersion.shards > 1``, layout in :mod:`dart.protocol.weights`)
is fetched from its manifest::

    read manifest (manifest_uri) -> it must describe the announced version and index (uri, sha256, count)
      -> the version's directory: file:// the store's own (read in place); s3:// cache_dir/v<N>-<sha>/
         (the index and each shard downloaded once per host)
      -> verify the index against the announced sha256, its files against the manifest's shards,
         and each shard against its sha256 in the manifest
      -> the directory (index + shards) goes to the engines, which stage it by hard link (vLLM)
         or read it (hf)

Any failure raises :class:`~dart.rollout.errors.WeightFetchError` before an engine is touched, so every
engine keeps serving its current version.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

from pydantic import ValidationError

from dart.protocol.errors import ConfigError, StoreError
from dart.protocol.messages import ModelVersion
from dart.protocol.store import StoreConfig, resolve_uri
from dart.protocol.weights import INDEX_NAME, WeightManifest, read_index
from dart.rollout.errors import WeightFetchError

_CHUNK = 1 << 20


def _sha256_file(path: Path) -> str | None:
    """The file's sha256, or None when it is not a readable file."""
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _local_path(uri: str) -> Path | None:
    """The path of a ``file://`` URI; None for ``s3://``.

    Raises:
        ValueError: Another scheme.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return Path(unquote(parsed.path))
    if parsed.scheme == "s3":
        return None
    raise ValueError("weight URIs must be file:// or s3://")


def _cache_root(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "dart-weights"


async def fetch_weights(
    version: ModelVersion, *, store_config: StoreConfig | None = None, cache_dir: str | Path | None = None
) -> Path:
    """A local, sha256-verified path of ``version``'s weights (see the module docstring).

    Args:
        version: The announced version.
        store_config: Endpoint and credentials of ``s3://`` URIs.
        cache_dir: Where ``s3://`` versions are downloaded (a temporary directory by default).

    Returns:
        The safetensors file of a one-shard version; the directory holding the index and the shards of a
        sharded one.

    Raises:
        WeightFetchError: Unsupported scheme, a missing object or manifest, or a digest that does not match.
    """
    if version.shards > 1:
        return await _fetch_sharded(version, store_config, _cache_root(cache_dir))
    try:
        local = _local_path(version.uri)
    except ValueError as exc:
        raise WeightFetchError(version.uri, version.version, str(exc)) from None
    if local is not None:
        path = local
    else:
        path = _cache_root(cache_dir) / f"v{version.version}-{version.sha256[:16]}.safetensors"
        if not path.is_file():
            await _download(version, version.uri, path, store_config)
    await _verify(version, path, version.sha256)
    return path


async def _fetch_sharded(version: ModelVersion, store_config: StoreConfig | None, cache: Path) -> Path:
    assert version.manifest_uri is not None  # ModelVersion requires it of sharded versions
    manifest = await _read_manifest(version, version.manifest_uri, store_config)
    try:
        local = _local_path(version.uri)
    except ValueError as exc:
        raise WeightFetchError(version.uri, version.version, str(exc)) from None
    directory = local.parent if local is not None else cache / f"v{version.version}-{version.sha256[:16]}"
    sources = {INDEX_NAME: version.uri} | {s.name: s.uri for s in manifest.shards}
    for name, uri in sources.items():
        path = directory / name
        if local is not None:
            if not uri.startswith("file:") or _local_path(uri) != path:  # read in place: all in one directory
                raise WeightFetchError(uri, version.version, f"the manifest places {name} outside {directory}")
        elif not path.is_file():
            await _download(version, uri, path, store_config)
    await _verify(version, directory / INDEX_NAME, version.sha256)
    try:
        files = set((await asyncio.to_thread(read_index, directory / INDEX_NAME)).values())
    except (OSError, ValueError) as exc:
        raise WeightFetchError(version.uri, version.version, f"unreadable index: {exc}") from exc
    if files != {s.name for s in manifest.shards}:
        detail = f"the index names shards {sorted(files)}, the manifest {[s.name for s in manifest.shards]}"
        raise WeightFetchError(version.uri, version.version, detail)
    for shard in manifest.shards:
        await _verify(version, directory / shard.name, shard.sha256, drop_bad=local is None)
    return directory


async def _read_manifest(version: ModelVersion, uri: str, store_config: StoreConfig | None) -> WeightManifest:
    """The manifest at ``uri``, checked to describe ``version`` (version, entry file, digest, shard count)."""

    def read() -> bytes:
        store, key = resolve_uri(uri, store_config)
        with store:
            return store.get(key)

    try:
        manifest = WeightManifest.model_validate_json(await asyncio.to_thread(read))
    except (StoreError, ConfigError, ValidationError) as exc:
        raise WeightFetchError(uri, version.version, f"cannot read the manifest: {exc}") from exc
    announced = (version.version, version.uri, version.sha256, version.shards)
    described = (manifest.version, manifest.weights_uri, manifest.sha256, len(manifest.shards))
    if described != announced:
        detail = f"the manifest describes (version, uri, sha256, shards) {described}, the announcement {announced}"
        raise WeightFetchError(uri, version.version, detail)
    return manifest


async def _verify(version: ModelVersion, path: Path, expected: str, *, drop_bad: bool = False) -> None:
    """Check ``path``'s sha256 (off the event loop: hashing GBs takes seconds); ``drop_bad`` deletes a bad
    download, so the next attempt fetches it again."""
    actual = await asyncio.to_thread(_sha256_file, path)
    if actual is None:
        raise WeightFetchError(version.uri, version.version, f"{path} is not a file")
    if actual != expected:
        if drop_bad:
            await asyncio.to_thread(path.unlink, True)
        raise WeightFetchError(version.uri, version.version, f"{path.name}: sha256 is {actual}, expected {expected}")


async def _download(version: ModelVersion, uri: str, path: Path, store_config: StoreConfig | None) -> None:
    def download() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        store, key = resolve_uri(uri, store_config)
        with store:
            store.get_to_file(key, path)

    try:
        await asyncio.to_thread(download)
    except (StoreError, ConfigError) as exc:
        raise WeightFetchError(uri, version.version, str(exc)) from exc
