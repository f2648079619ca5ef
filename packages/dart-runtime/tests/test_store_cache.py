"""ArtifactCache: bounded by bytes, least recently used out first, one client per location, digests checked."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dart.protocol.errors import ArtifactNotFoundError, IntegrityError, InvalidURIError
from dart.runtime.store import LocalStore, StoreConfig, file_uri, parse_store_uri
from dart.runtime.store.cache import ArtifactCache
from dart.runtime.store.uri import key_in

pytestmark = pytest.mark.unit


def test_reads_are_cached_up_to_the_byte_bound_lru_first_out(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "a", fsync=False)
    blobs = {name: name.encode() * 400 for name in ("x", "y", "z")}  # 400 bytes each
    refs = {n: (store.put(f"shots/{n}.png", b).uri, hashlib.sha256(b).hexdigest()) for n, b in blobs.items()}
    cache = ArtifactCache(max_bytes=1000)
    assert cache.get(*refs["x"]) == blobs["x"] and cache.get(*refs["y"]) == blobs["y"]
    assert cache.get(*refs["x"]) == blobs["x"]  # a hit; x is now the most recent
    assert (cache.hits, cache.misses, cache.cached_bytes) == (1, 2, 800)
    cache.get(*refs["z"])  # over the bound: y, the least recently used, goes
    assert cache.cached_bytes == 800
    cache.get(*refs["x"])
    assert cache.hits == 2
    cache.get(*refs["y"])
    assert cache.misses == 4  # y was read again from the store
    cache.close()
    assert cache.cached_bytes == 0


def test_a_wrong_digest_or_a_missing_artifact_is_a_typed_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "a", fsync=False)
    uri = store.put("shots/a.png", b"abc").uri
    cache = ArtifactCache()
    with pytest.raises(IntegrityError):
        cache.get(uri, "0" * 64)
    with pytest.raises(ArtifactNotFoundError):
        cache.get(store.uri("shots/missing.png"), "0" * 64)
    big = ArtifactCache(max_bytes=2)
    assert big.get(uri, hashlib.sha256(b"abc").hexdigest()) == b"abc" and big.cached_bytes == 0  # too big to keep


def test_a_reference_outside_the_runs_store_is_refused_unread(tmp_path: Path) -> None:
    root = tmp_path / "run" / "artifacts"
    store = LocalStore(root, fsync=False)
    inside = store.put("screenshots/a.png", b"abc").uri
    outside = LocalStore(tmp_path / "other", fsync=False).put("a.png", b"abc").uri
    sha = hashlib.sha256(b"abc").hexdigest()
    cache = ArtifactCache(StoreConfig(uri=file_uri(root)))
    assert cache.get(inside, sha) == b"abc"
    beside = file_uri(tmp_path / "run" / "artifacts-x" / "a.png")  # a sibling sharing the root's name as a prefix
    for uri in (outside, "file:///etc/hostname", "file:///dev/zero", "s3://dart/artifacts/screenshots/a.png", beside):
        with pytest.raises(InvalidURIError, match="outside the run's store"):
            cache.get(uri, sha)
    assert cache.misses == 1


def test_key_in_compares_scheme_bucket_and_prefix() -> None:
    run = parse_store_uri("s3://dart/run-1")
    assert key_in(run, "s3://dart/run-1/screenshots/a.png") == "screenshots/a.png"
    assert [key_in(run, u) for u in ("s3://dart/run-10/a", "s3://other/run-1/a", "file:///run-1/a")] == [None] * 3
    assert key_in(parse_store_uri("s3://dart"), "s3://dart/a/b") == "a/b"
    with pytest.raises(InvalidURIError):
        key_in(parse_store_uri("file:///srv/art"), "file:///srv/art/../../etc/passwd")
