"""The ArtifactStore contract, run unchanged against every backend.

``local`` runs on a temporary directory (unit tier); ``s3`` runs against the session's real
SeaweedFS server (integration tier), each test under its own key prefix in a shared bucket.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import random
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dart.protocol.errors import ArtifactNotFoundError, IntegrityError, InvalidURIError, StoreError
from dart.runtime.store import ArtifactStore, LocalStore, S3Store, StoreConfig, get_by_uri, resolve_uri
from dart.runtime.store.interface import MiB

BUCKET = "dart-contract"


@pytest.fixture(
    params=[
        pytest.param("local", marks=pytest.mark.unit),
        pytest.param("s3", marks=pytest.mark.integration),
    ]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ArtifactStore]:
    """A fresh, empty store of each backend."""
    if request.param == "local":
        with LocalStore(tmp_path / "artifacts", fsync=False) as local:
            yield local
        return
    server = request.getfixturevalue("s3_server")
    with S3Store(
        BUCKET,
        endpoint=server.endpoint,
        access_key=server.access_key,
        secret_key=server.secret_key,
        secure=False,
        region=server.region,
        prefix=f"t-{uuid.uuid4().hex[:12]}",
    ) as s3:
        yield s3


@pytest.fixture
def store_config(store: ArtifactStore, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> StoreConfig:
    """A StoreConfig equivalent to ``store`` (credentials through the environment, as in production)."""
    if isinstance(store, LocalStore):
        return StoreConfig(uri=f"file://{store.root}", fsync=False)
    assert isinstance(store, S3Store)
    server = request.getfixturevalue("s3_server")
    monkeypatch.setenv("DART_S3_ACCESS_KEY", server.access_key)
    monkeypatch.setenv("DART_S3_SECRET_KEY", server.secret_key)
    return StoreConfig(uri=store.uri_prefix, endpoint=server.url, region=server.region)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- put / get / stat ------------------------------------------------------------------------


def test_put_then_get_round_trips_and_describes_the_artifact(store: ArtifactStore) -> None:
    data = b"screenshot bytes \x00\xff" * 100
    info = store.put("runs/1/step-0.png", data, content_type="image/png", metadata={"policy-version": "7"})
    assert info.key == "runs/1/step-0.png"
    assert info.uri == store.uri("runs/1/step-0.png")
    assert info.size == len(data)
    assert info.sha256 == _sha(data)
    assert info.content_type == "image/png"
    assert info.metadata == {"policy-version": "7"}
    assert info.etag and info.modified is not None
    assert store.get("runs/1/step-0.png") == data

    stat = store.stat("runs/1/step-0.png")
    assert (stat.uri, stat.key, stat.size, stat.sha256) == (info.uri, info.key, info.size, info.sha256)
    assert (stat.content_type, stat.metadata, stat.etag) == ("image/png", {"policy-version": "7"}, info.etag)


def test_empty_artifact(store: ArtifactStore) -> None:
    info = store.put("empty", b"")
    assert info.size == 0 and info.sha256 == _sha(b"")
    assert store.get("empty") == b""
    assert list(store.get_stream("empty")) == []


def test_default_content_type(store: ArtifactStore) -> None:
    assert store.put("k", b"x").content_type == "application/octet-stream"
    assert store.stat("k").content_type == "application/octet-stream"


def test_overwrite_replaces_bytes_and_metadata(store: ArtifactStore) -> None:
    store.put("k", b"first", metadata={"n": "1"})
    info = store.put("k", b"second, longer", metadata={"n": "2"})
    assert store.get("k") == b"second, longer"
    assert store.stat("k").metadata == {"n": "2"}
    assert store.stat("k").sha256 == info.sha256 == _sha(b"second, longer")


def test_without_digest_nothing_is_recorded_and_reads_still_work(store: ArtifactStore) -> None:
    store.put("k", b"old")  # a digest recorded for the old bytes must not linger
    info = store.put("k", b"data", sha256=False)
    assert info.sha256 is None
    assert store.stat("k").sha256 is None
    assert store.get("k") == b"data"


def test_expected_digest_is_checked_and_recorded(store: ArtifactStore) -> None:
    data = b"weights"
    assert store.put("ok", data, sha256=_sha(data)).sha256 == _sha(data)
    assert store.stat("ok").sha256 == _sha(data)
    with pytest.raises(IntegrityError) as info:
        store.put("bad", data, sha256=_sha(b"something else"))
    assert info.value.expected == _sha(b"something else") and info.value.actual == _sha(data)
    assert not store.exists("bad")


def test_a_wrong_expected_digest_keeps_the_previous_artifact(store: ArtifactStore) -> None:
    store.put("k", b"good")
    with pytest.raises(IntegrityError):
        store.put("k", b"evil", sha256=_sha(b"what the caller expected"))
    assert store.get("k") == b"good"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sha256": "abc"}, "64-char lowercase hex"),
        ({"sha256": "A" * 64}, "64-char lowercase hex"),
        ({"metadata": {"Upper": "x"}}, "metadata key 'Upper' is invalid"),
        ({"metadata": {"a_b": "x"}}, "metadata key 'a_b' is invalid"),
        ({"metadata": {"sha256": "x"}}, "reserved"),
        ({"metadata": {"k": "caf\u00e9"}}, "printable ASCII"),
        ({"metadata": {"k": " padded"}}, "printable ASCII"),
        ({"metadata": {"k": "x" * 1100}}, "at most 1024"),
        ({"content_type": "not a type"}, "MIME type"),
    ],
)
def test_bad_write_arguments_are_rejected_before_any_io(
    store: ArtifactStore, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        store.put("k", b"x", **kwargs)
    assert not store.exists("k")


def test_put_rejects_non_bytes(store: ArtifactStore) -> None:
    with pytest.raises(TypeError, match="put_stream"):
        store.put("k", "text")  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "dir/", ".dart-meta/x"])
def test_every_operation_validates_keys(store: ArtifactStore, key: str) -> None:
    operations = [
        lambda: store.put(key, b"x"),
        lambda: store.put_stream(key, [b"x"]),
        lambda: store.get(key),
        lambda: store.get_stream(key),
        lambda: store.stat(key),
        lambda: store.exists(key),
        lambda: store.delete(key),
        lambda: store.uri(key),
    ]
    for operation in operations:
        with pytest.raises(InvalidURIError):
            operation()


# -- missing keys and delete -----------------------------------------------------------------


def test_missing_key_raises_not_found_everywhere(store: ArtifactStore) -> None:
    for operation in (store.get, store.stat, store.get_stream):
        with pytest.raises(ArtifactNotFoundError) as info:
            operation("no/such/key")
        assert info.value.uri == store.uri("no/such/key")
    # ArtifactNotFoundError is also a KeyError, for dict-like callers.
    with pytest.raises(KeyError):
        store.get("no/such/key")
    assert not store.exists("no/such/key")


def test_delete_is_idempotent(store: ArtifactStore) -> None:
    store.put("a/b", b"x")
    assert store.exists("a/b")
    store.delete("a/b")
    assert not store.exists("a/b")
    store.delete("a/b")
    store.delete("never/existed")
    assert list(store.list()) == []


# -- list ------------------------------------------------------------------------------------


def test_list_is_recursive_and_filters_by_string_prefix(store: ArtifactStore) -> None:
    keys = ["runs/1/a", "runs/1/sub/b", "runs/10/c", "runs/2/d", "runs.txt", "other/x", "z"]
    for i, key in enumerate(keys):
        store.put(key, b"x" * i)

    def listed(prefix: str = "") -> list[str]:
        # Order is backend-defined (SeaweedFS lists directory by directory), so compare sorted.
        return sorted(i.key for i in store.list(prefix))

    assert listed() == sorted(keys)
    assert listed("runs/1/") == ["runs/1/a", "runs/1/sub/b"]
    assert listed("runs/1") == ["runs/1/a", "runs/1/sub/b", "runs/10/c"]
    assert listed("runs") == ["runs.txt", "runs/1/a", "runs/1/sub/b", "runs/10/c", "runs/2/d"]
    assert listed("runs/1/sub/b") == ["runs/1/sub/b"]
    assert listed("nothing/") == []
    infos = {i.key: i for i in store.list()}
    assert infos["runs/2/d"].size == 3
    assert infos["runs/2/d"].uri == store.uri("runs/2/d")


def test_list_of_an_empty_store_is_empty(store: ArtifactStore) -> None:
    assert list(store.list()) == []
    assert list(store.list("a/")) == []


@pytest.mark.parametrize("prefix", ["/a", "a/../", "../"])
def test_list_rejects_prefixes_that_cannot_match(store: ArtifactStore, prefix: str) -> None:
    with pytest.raises(InvalidURIError):
        list(store.list(prefix))


# -- streaming -------------------------------------------------------------------------------


def test_put_stream_from_chunks_and_from_a_file_object(store: ArtifactStore) -> None:
    chunks = [b"alpha", b"", b"beta", b"gamma" * 1000]
    info = store.put_stream("gen", iter(chunks))
    assert info.sha256 == _sha(b"".join(chunks)) and info.size == len(b"".join(chunks))
    assert store.get("gen") == b"".join(chunks)

    data = bytes(range(256)) * 100
    info = store.put_stream("file", io.BytesIO(data), size=len(data), content_type="application/json")
    assert store.stat("file").content_type == "application/json"
    assert store.get("file") == data


def test_put_stream_size_mismatch_stores_nothing(store: ArtifactStore) -> None:
    with pytest.raises(StoreError, match="size=10"):
        store.put_stream("short", io.BytesIO(b"12345"), size=10)
    with pytest.raises(StoreError, match="size=3"):
        store.put_stream("long", io.BytesIO(b"12345"), size=3)
    assert not store.exists("short") and not store.exists("long")


@pytest.mark.parametrize("part_size", [0, 4 * MiB, 6 * 1024 * MiB])
def test_put_stream_rejects_part_sizes_outside_the_s3_limits(store: ArtifactStore, part_size: int) -> None:
    with pytest.raises(ValueError, match="part_size"):
        store.put_stream("k", [b"x"], part_size=part_size)
    assert not store.exists("k")


def test_put_stream_rejects_text_and_bytes_sources(store: ArtifactStore) -> None:
    with pytest.raises(TypeError, match="binary"):
        store.put_stream("k", io.StringIO("text"))
    with pytest.raises(TypeError, match="use put"):
        store.put_stream("k", b"raw bytes")
    assert not store.exists("k")


def test_a_failing_reader_leaves_the_previous_artifact_intact(store: ArtifactStore) -> None:
    store.put("k", b"good")

    def broken() -> Iterator[bytes]:
        yield b"partial"
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError, match="source died"):
        store.put_stream("k", broken())
    assert store.get("k") == b"good"
    assert [i.key for i in store.list()] == ["k"]


def test_get_stream_yields_bounded_chunks_and_closes_early(store: ArtifactStore) -> None:
    data = random.Random(1).randbytes(100_000)
    store.put("k", data)
    with store.get_stream("k", chunk_size=4096) as stream:
        assert stream.info.size == len(data) and stream.info.sha256 == _sha(data)
        chunks = list(stream)
    assert b"".join(chunks) == data
    assert max(len(c) for c in chunks) <= 4096
    with store.get_stream("k", chunk_size=1000) as stream:
        assert next(stream) == data[:1000]
    stream.close()  # idempotent
    with pytest.raises(ValueError, match="chunk_size"):
        store.get_stream("k", chunk_size=0)


def _seeded_chunks(seed: int, count: int, size: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    for _ in range(count):
        yield rng.randbytes(size)


def test_50mb_streaming_round_trip_in_bounded_memory(store: ArtifactStore) -> None:
    chunk, count, part = 1 * MiB, 50, 5 * MiB
    expected = hashlib.sha256()
    for c in _seeded_chunks(7, count, chunk):
        expected.update(c)

    tracemalloc.start()
    try:
        info = store.put_stream("big/blob.bin", _seeded_chunks(7, count, chunk), part_size=part)
        _, put_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        got = hashlib.sha256()
        total = 0
        with store.get_stream("big/blob.bin", chunk_size=chunk) as stream:
            for c in stream:
                assert len(c) <= chunk
                got.update(c)
                total += len(c)
        _, get_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert info.size == total == chunk * count
    assert info.sha256 == got.hexdigest() == expected.hexdigest()
    assert store.stat("big/blob.bin").sha256 == expected.hexdigest()
    # Nowhere near the 50 MiB object: a few parts on the way up (the S3 SDK copies each part
    # while framing it), a chunk or two on the way down.
    assert put_peak < 4 * part, f"put_stream peaked at {put_peak / MiB:.1f} MiB"
    assert get_peak < 8 * MiB, f"get_stream peaked at {get_peak / MiB:.1f} MiB"
    assert [i.key for i in store.list()] == ["big/blob.bin"], "no staging or temporary objects remain"


# -- files -----------------------------------------------------------------------------------


def test_put_file_and_get_to_file(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "model.safetensors"
    data = random.Random(3).randbytes(300_000)
    src.write_bytes(data)
    info = store.put_file("weights/v1/model.safetensors", src, metadata={"version": "1"})
    assert info.sha256 == _sha(data) and info.size == len(data)

    dst = tmp_path / "out" / "model.safetensors"
    dst.parent.mkdir()
    got = store.get_to_file("weights/v1/model.safetensors", dst)
    assert dst.read_bytes() == data
    assert got.sha256 == _sha(data) and got.metadata == {"version": "1"}
    assert sorted(p.name for p in dst.parent.iterdir()) == ["model.safetensors"]


def test_put_file_of_a_missing_file_is_a_store_error(store: ArtifactStore, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="cannot read"):
        store.put_file("k", tmp_path / "missing.bin")


def test_get_to_file_of_a_missing_key_leaves_no_file(store: ArtifactStore, tmp_path: Path) -> None:
    with pytest.raises(ArtifactNotFoundError):
        store.get_to_file("missing", tmp_path / "out.bin")
    assert list(tmp_path.iterdir()) == [] or all(p.name == "artifacts" for p in tmp_path.iterdir())


# -- URIs and async --------------------------------------------------------------------------


def test_artifact_uris_resolve_back_to_the_artifact(store: ArtifactStore, store_config: StoreConfig) -> None:
    info = store.put("weights/v2/model.safetensors", b"tensor bytes")
    assert get_by_uri(info.uri, config=store_config) == b"tensor bytes"
    resolved, key = resolve_uri(info.uri, store_config)
    with resolved:
        assert resolved.stat(key).sha256 == info.sha256
        assert resolved.uri(key) == info.uri
    with pytest.raises(ArtifactNotFoundError):
        get_by_uri(store.uri("weights/v2/missing"), config=store_config)


def test_store_config_opens_an_equivalent_store(store: ArtifactStore, store_config: StoreConfig) -> None:
    store.put("a/b", b"shared")
    with store_config.open() as other:
        assert other.get("a/b") == b"shared"
        assert other.uri("a/b") == store.uri("a/b")


async def test_async_wrappers(store: ArtifactStore, tmp_path: Path) -> None:
    info = await store.aput("a", b"async bytes", metadata={"k": "v"})
    assert await store.aget("a") == b"async bytes"
    assert (await store.astat("a")).sha256 == info.sha256
    assert await store.aexists("a")
    src = tmp_path / "src.bin"
    src.write_bytes(b"file bytes")
    await store.aput_file("f", src)
    await store.aget_to_file("f", tmp_path / "dst.bin")
    assert (tmp_path / "dst.bin").read_bytes() == b"file bytes"
    results = await asyncio.gather(*(store.aput(f"many/{i}", bytes([i])) for i in range(8)))
    assert [r.size for r in results] == [1] * 8
    await store.adelete("a")
    assert not await store.aexists("a")
