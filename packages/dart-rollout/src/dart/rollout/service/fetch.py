"""Fetching a published weight version for the engines: the one place that resolves weight URIs.

A one-shard version is a single safetensors file: its ``file://`` path is used in place and hashed, an
``s3://`` one is downloaded into the cache directory once per host, hashed as it is written and kept only
when its sha256 is the announcement's. A sharded version (``ModelVersion.shards > 1``, layout in
:mod:`dart.protocol.weights`) is fetched from its manifest::

    read manifest (manifest_uri) -> it must describe the announced version and index (uri, sha256, count)
      -> the version's directory: file:// the store's own (read in place); s3:// cache_dir/v<N>-<sha>/
         (the index and each shard downloaded once per host, FETCH_CONCURRENCY shards at a time, each
         hashed as it is written and kept only if its digest is the manifest's; a failed transfer is
         retried FETCH_ATTEMPTS times; a file already downloaded is hashed again and dropped if it changed)
      -> verify the index against the announced sha256, its files against the manifest's shards, and
         each shard read in place against its sha256 in the manifest (concurrently: hashing releases
         the GIL)
      -> the directory (index + shards) goes to the engines, which stage it by hard link (vLLM)
         or read it (hf)

Any failure raises :class:`~dart.rollout.errors.WeightFetchError` before an engine is touched, so every
engine keeps serving its current version.

The download cache is bounded: with ``keep`` set, a successful download leaves only the ``keep`` newest
versions in the cache directory (the one just fetched always among them, even when it is an old version
an evaluation asked for). Engines do not need the files once loaded (hf reads them into memory, vLLM
stages its own hard links), so a 7B run no longer fills the disk by 16.6 GB a version.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from pydantic import ValidationError

from dart.protocol.errors import ArtifactNotFoundError, ConfigError, StoreAuthError, StoreError
from dart.protocol.messages import ModelVersion
from dart.protocol.weights import INDEX_NAME, WeightManifest, read_index
from dart.rollout.errors import WeightFetchError
from dart.runtime.store import StoreConfig, resolve_uri

log = logging.getLogger("dart.rollout.sync")

_CHUNK = 1 << 20
FETCH_CONCURRENCY = 4
"""Shards of a version downloaded at a time by one host."""
FETCH_ATTEMPTS = 3
"""Tries per shard transfer (the store's own timeouts bound each)."""
FETCH_CHUNK = 8 << 20
"""Bytes per read of a downloaded shard."""


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


def cache_root(cache_dir: str | Path | None) -> Path:
    """The download cache directory of ``cache_dir`` (a temporary directory's ``dart-weights`` when None)."""
    return Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "dart-weights"


_CACHED = re.compile(r"^v(\d+)-[0-9a-f]{16}(\.safetensors)?$")
"""A version's entry in the download cache: its file (one shard) or its directory (sharded)."""


async def fetch_weights(
    version: ModelVersion,
    *,
    store_config: StoreConfig | None = None,
    cache_dir: str | Path | None = None,
    keep: int | None = None,
) -> Path:
    """A local, sha256-verified path of ``version``'s weights (see the module docstring).

    Args:
        version: The announced version.
        store_config: Endpoint and credentials of ``s3://`` URIs.
        cache_dir: Where ``s3://`` versions are downloaded (a temporary directory by default).
        keep: Versions left in the download cache after a download (the newest, this one always
            included); None keeps every one.

    Returns:
        The safetensors file of a one-shard version; the directory holding the index and the shards of a
        sharded one.

    Raises:
        WeightFetchError: Unsupported scheme, a missing object or manifest, or a digest that does not match.
    """
    path = await _fetch(version, store_config, cache_dir)
    root = cache_root(cache_dir)
    if keep is not None and path.parent == root:  # downloaded (a file:// version is read in place)
        await asyncio.to_thread(_prune, root, keep, path.name)
    return path


def cache_usage(cache_dir: str | Path | None) -> tuple[int, int]:
    """The download cache's versions and bytes (every version entry's files; the temporary files of downloads
    in progress not counted). ``(0, 0)`` when nothing was downloaded."""
    root = cache_root(cache_dir)
    versions = size = 0
    if not root.is_dir():
        return 0, 0
    for entry in root.iterdir():
        if not _CACHED.match(entry.name):
            continue
        versions += 1
        files = entry.rglob("*") if entry.is_dir() else (entry,)
        size += sum(f.stat().st_size for f in files if f.is_file())
    return versions, size


def _prune(root: Path, keep: int, fetched: str) -> None:
    """Delete all but the ``keep`` newest versions in the cache ``root``, never ``fetched``."""
    entries = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if (m := _CACHED.match(p.name))), key=lambda e: e[0], reverse=True
    )
    others = [p.name for _, p in entries if p.name != fetched]
    kept = {fetched, *others[: max(keep - 1, 0)]}
    for _, path in entries:
        if path.name in kept:
            continue
        log.info("dropping weights %s from the download cache (keeping %d versions)", path.name, keep)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


async def _fetch(version: ModelVersion, store_config: StoreConfig | None, cache_dir: str | Path | None) -> Path:
    if version.shards > 1:
        return await _fetch_sharded(version, store_config, cache_root(cache_dir))
    try:
        local = _local_path(version.uri)
    except ValueError as exc:
        raise WeightFetchError(version.uri, version.version, str(exc)) from None
    if local is not None:
        await _verify(version, local, version.sha256)
        return local
    path = cache_root(cache_dir) / f"v{version.version}-{version.sha256[:16]}.safetensors"
    if path.is_file():  # verified when downloaded; hashed again, and dropped if it changed on disk since
        await _verify(version, path, version.sha256, drop_bad=True)
    else:
        await _download_verified(version, version.uri, path, version.sha256, store_config)
    return path


async def _fetch_sharded(version: ModelVersion, store_config: StoreConfig | None, cache: Path) -> Path:
    assert version.manifest_uri is not None  # ModelVersion requires it of sharded versions
    manifest = await _read_manifest(version, version.manifest_uri, store_config)
    try:
        local = _local_path(version.uri)
    except ValueError as exc:
        raise WeightFetchError(version.uri, version.version, str(exc)) from None
    directory = local.parent if local is not None else cache / f"v{version.version}-{version.sha256[:16]}"
    expected = {INDEX_NAME: version.sha256} | {s.name: s.sha256 for s in manifest.shards}
    sources = {INDEX_NAME: version.uri} | {s.name: s.uri for s in manifest.shards}
    if local is not None:
        for name, uri in sources.items():
            if not uri.startswith("file:") or _local_path(uri) != directory / name:  # read in place: one directory
                raise WeightFetchError(uri, version.version, f"the manifest places {name} outside {directory}")
        await _verify(version, directory / INDEX_NAME, version.sha256)
    else:
        gate = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def fetch(name: str) -> None:
            async with gate:
                await _download_verified(version, sources[name], directory / name, expected[name], store_config)

        # A file already there was verified when it was downloaded; it is checked again (and dropped if it
        # changed on disk since), the rest are downloaded.
        cached = {name for name in sources if (directory / name).is_file()}
        await _all(
            _verify(version, directory / name, expected[name], drop_bad=True) if name in cached else fetch(name)
            for name in sources
        )
    try:
        files = set((await asyncio.to_thread(read_index, directory / INDEX_NAME)).values())
    except (OSError, ValueError) as exc:
        raise WeightFetchError(version.uri, version.version, f"unreadable index: {exc}") from exc
    if files != {s.name for s in manifest.shards}:
        detail = f"the index names shards {sorted(files)}, the manifest {[s.name for s in manifest.shards]}"
        raise WeightFetchError(version.uri, version.version, detail)
    if local is not None:
        await _all(_verify(version, directory / shard.name, shard.sha256) for shard in manifest.shards)
    return directory


async def _all(jobs: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run ``jobs`` concurrently; the first failure cancels the rest and is raised (not as a group)."""
    try:
        async with asyncio.TaskGroup() as group:
            for job in jobs:
                group.create_task(job)
    except* WeightFetchError as failed:
        raise failed.exceptions[0] from None


async def _read_manifest(version: ModelVersion, uri: str, store_config: StoreConfig | None) -> WeightManifest:
    """The manifest at ``uri``, checked to describe ``version`` (version, entry file, digest, shard count)."""

    def read() -> bytes:
        store, key = resolve_uri(uri, store_config)
        with store:
            return store.get(key)

    try:
        body = await asyncio.to_thread(read)
    except (StoreError, ConfigError) as exc:
        raise WeightFetchError(uri, version.version, f"cannot read the manifest: {exc}") from exc
    # The digest first: nothing of a manifest that is not the one announced is read (shard names
    # become file names below the download directory).
    actual = hashlib.sha256(body).hexdigest()
    if actual != version.manifest_sha256:
        detail = f"the manifest's sha256 is {actual}, the announcement's {version.manifest_sha256}"
        raise WeightFetchError(uri, version.version, detail)
    try:
        manifest = WeightManifest.model_validate_json(body)
    except ValidationError as exc:
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


async def _download_verified(
    version: ModelVersion, uri: str, path: Path, expected: str, store_config: StoreConfig | None
) -> None:
    """Download ``uri`` to ``path``, hashing the bytes as they are written; the file appears only when its
    sha256 is ``expected``. A failed transfer is retried (FETCH_ATTEMPTS in all); a wrong digest is not."""

    def download() -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A name of its own: another process on this host (a validation engine, a second rollout service)
        # may be downloading the same file into the same cache.
        tmp = path.with_name(f".dart-tmp-{uuid.uuid4().hex}-{path.name}")
        digest = hashlib.sha256()
        store, key = resolve_uri(uri, store_config)
        try:
            with store, store.get_stream(key, verify=False, chunk_size=FETCH_CHUNK) as stream, tmp.open("wb") as out:
                for chunk in stream:
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() == expected:
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return digest.hexdigest()

    for attempt in range(1, FETCH_ATTEMPTS + 1):
        try:
            actual = await asyncio.to_thread(download)
            break
        except (StoreError, ConfigError, OSError) as exc:
            # A missing object or refused credentials stay so: only transfer failures are retried.
            if attempt == FETCH_ATTEMPTS or isinstance(exc, ConfigError | ArtifactNotFoundError | StoreAuthError):
                raise WeightFetchError(uri, version.version, f"{type(exc).__name__}: {exc}") from exc
            await asyncio.sleep(0.5 * attempt)
    if actual != expected:
        raise WeightFetchError(uri, version.version, f"{path.name}: sha256 is {actual}, expected {expected}")
