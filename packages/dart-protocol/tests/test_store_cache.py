"""ArtifactCache: bounded by bytes, least recently used out first, one client per location, digests checked."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dart.protocol.errors import ArtifactNotFoundError, IntegrityError
from dart.protocol.store import LocalStore
from dart.protocol.store.cache import ArtifactCache

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
