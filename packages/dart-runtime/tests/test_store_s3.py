"""S3Store specifics against a real S3 server (SeaweedFS): integrity, errors, staging, prefixes."""

from __future__ import annotations

import hashlib
import io
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from minio import Minio
from minio.error import S3Error

from dart.embedded.s3 import EmbeddedS3
from dart.protocol.errors import (
    ArtifactNotFoundError,
    IntegrityError,
    StoreAuthError,
    StoreError,
    StoreUnavailableError,
)
from dart.runtime.store import S3Store, StoreConfig, get_by_uri, open_store, resolve_uri
from dart.runtime.store.interface import MiB

pytestmark = pytest.mark.integration

BUCKET = "dart-s3-tests"


@pytest.fixture
def raw(s3_server: EmbeddedS3) -> Minio:
    """A plain minio client, to look at and tamper with objects behind the store's back."""
    return Minio(s3_server.endpoint, access_key=s3_server.access_key, secret_key=s3_server.secret_key, secure=False)


def _store(server: EmbeddedS3, **overrides: Any) -> S3Store:
    kwargs: dict[str, Any] = {
        "endpoint": server.endpoint,
        "access_key": server.access_key,
        "secret_key": server.secret_key,
        "secure": False,
        "region": server.region,
        "prefix": f"t-{uuid.uuid4().hex[:12]}",
    }
    kwargs.update(overrides)
    return S3Store(kwargs.pop("bucket", BUCKET), **kwargs)


@pytest.fixture
def store(s3_server: EmbeddedS3) -> Iterator[S3Store]:
    with _store(s3_server) as s:
        yield s


def _overwrite_keeping_metadata(raw: Minio, store: S3Store, key: str, data: bytes) -> None:
    """Replace an object's bytes while keeping the digest the store recorded, as a bad disk or a
    buggy tool would."""
    name = store.object_name(key)
    recorded = raw.stat_object(store.bucket, name).metadata
    digest = next(v for k, v in recorded.items() if k.lower() == "x-amz-meta-sha256")
    raw.put_object(store.bucket, name, io.BytesIO(data), len(data), metadata={"sha256": digest})


def test_digest_is_recorded_as_object_metadata(store: S3Store, raw: Minio) -> None:
    data = b"weights"
    store.put("w", data, metadata={"policy-version": "4"})
    headers = {k.lower(): v for k, v in raw.stat_object(store.bucket, store.object_name("w")).metadata.items()}
    assert headers["x-amz-meta-sha256"] == hashlib.sha256(data).hexdigest()
    assert headers["x-amz-meta-policy-version"] == "4"


def test_corruption_is_detected_on_get_and_get_stream(store: S3Store, raw: Minio, tmp_path: Path) -> None:
    data = random.Random(5).randbytes(200_000)
    info = store.put("blob", data)
    corrupted = bytearray(data)
    corrupted[100_000] ^= 0xFF
    _overwrite_keeping_metadata(raw, store, "blob", bytes(corrupted))
    assert store.stat("blob").sha256 == info.sha256  # the metadata still claims the old digest

    with pytest.raises(IntegrityError) as exc:
        store.get("blob")
    assert (exc.value.uri, exc.value.expected) == (info.uri, info.sha256)
    assert exc.value.actual == hashlib.sha256(corrupted).hexdigest()

    received = bytearray()
    with pytest.raises(IntegrityError), store.get_stream("blob", chunk_size=16_384) as stream:
        for chunk in stream:
            received += chunk
    assert bytes(received) == bytes(corrupted)  # all chunks arrive; the verdict comes after the last

    assert store.get("blob", verify=False) == bytes(corrupted)
    with pytest.raises(IntegrityError):
        store.get_to_file("blob", tmp_path / "blob")
    assert list(tmp_path.iterdir()) == []


def test_wrong_credentials_are_a_clear_store_auth_error(s3_server: EmbeddedS3) -> None:
    with _store(s3_server, secret_key="not-the-secret") as bad:
        operations = [
            lambda: bad.put("k", b"x"),
            lambda: bad.get("k"),
            lambda: bad.stat("k"),
            lambda: bad.exists("k"),
            lambda: list(bad.list()),
            lambda: bad.delete("k"),
        ]
        for operation in operations:
            with pytest.raises(StoreAuthError) as exc:
                operation()
            assert isinstance(exc.value, StoreError)
            assert exc.value.endpoint == s3_server.endpoint
            # HEAD answers carry no error body, so the SDK reports those as AccessDenied.
            assert exc.value.code in ("SignatureDoesNotMatch", "AccessDenied")
            assert "refused the credentials" in str(exc.value) and "secret_key" in str(exc.value)
    with _store(s3_server, access_key="NOSUCHKEY") as unknown, pytest.raises(StoreAuthError):
        unknown.put("k", b"x")


def test_unreachable_endpoint_is_a_store_unavailable_error(s3_server: EmbeddedS3) -> None:
    from dart.runtime.ports import free_port

    dead = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with _store(s3_server, endpoint=dead, max_retries=1) as store, pytest.raises(StoreUnavailableError) as exc:
        store.get("k")
    assert exc.value.endpoint == dead and "cannot reach" in str(exc.value)
    assert time.monotonic() - started < 5


def test_bucket_is_created_on_first_write_only_when_allowed(s3_server: EmbeddedS3, raw: Minio) -> None:
    name = f"fresh-{uuid.uuid4().hex[:8]}"
    with _store(s3_server, bucket=name, create_bucket=False) as strict:
        assert list(strict.list()) == []
        assert not strict.exists("k")
        with pytest.raises(ArtifactNotFoundError):
            strict.get("k")
        with pytest.raises(StoreError, match="does not exist.*create_bucket"):
            strict.put("k", b"x")
    assert not raw.bucket_exists(name)
    with _store(s3_server, bucket=name) as lenient:
        lenient.put("k", b"x")
        assert lenient.get("k") == b"x"
    assert raw.bucket_exists(name)


def _chunks(seed: int, count: int, size: int = 1 * MiB) -> Iterator[bytes]:
    rng = random.Random(seed)
    for _ in range(count):
        yield rng.randbytes(size)


def test_large_stream_of_unknown_digest_goes_through_staging_and_leaves_none(store: S3Store, raw: Minio) -> None:
    expected = hashlib.sha256(b"".join(_chunks(1, 12))).hexdigest()
    info = store.put_stream("big", _chunks(1, 12), part_size=5 * MiB, content_type="application/x-st")
    assert info.sha256 == expected and info.size == 12 * MiB
    names = [o.object_name for o in raw.list_objects(store.bucket, prefix=store.prefix + "/", recursive=True)]
    assert names == [store.object_name("big")]
    stat = store.stat("big")
    assert (stat.sha256, stat.content_type, stat.size) == (expected, "application/x-st", 12 * MiB)


def test_large_stream_with_a_wrong_digest_or_size_stores_nothing(store: S3Store, raw: Minio) -> None:
    with pytest.raises(IntegrityError):
        store.put_stream("big", _chunks(2, 7), part_size=5 * MiB, sha256="0" * 64)
    with pytest.raises(StoreError, match="size="):
        store.put_stream("big", _chunks(2, 7), size=8 * MiB, part_size=5 * MiB)
    with pytest.raises(StoreError, match="size="):
        store.put_stream("big", _chunks(2, 7), size=6 * MiB, part_size=5 * MiB)
    assert list(raw.list_objects(store.bucket, prefix=store.prefix + "/", recursive=True)) == []


def test_prefixes_isolate_stores_sharing_a_bucket(s3_server: EmbeddedS3) -> None:
    with _store(s3_server, prefix="team-a/run-1") as a, _store(s3_server, prefix="team-a/run-2") as b:
        a.put("x", b"a")
        b.put("x", b"b")
        assert (a.get("x"), b.get("x")) == (b"a", b"b")
        assert [i.key for i in a.list()] == ["x"]
        assert a.object_name("x") == "team-a/run-1/x"
        assert a.uri("x") == f"s3://{BUCKET}/team-a/run-1/x"
        assert a.uri_prefix == f"s3://{BUCKET}/team-a/run-1"
        a.delete("x")
        b.delete("x")
    with _store(s3_server, prefix="") as root:
        assert root.object_name("x") == "x" and root.uri("x") == f"s3://{BUCKET}/x"


def test_objects_from_other_writers(store: S3Store, raw: Minio) -> None:
    # Written without the store: readable, just without a digest to verify against.
    raw.put_object(store.bucket, store.object_name("foreign"), io.BytesIO(b"plain"), 5)
    # A name the store could not have written is left out of listings.
    raw.put_object(store.bucket, f"{store.prefix}/.dart-staging/orphan", io.BytesIO(b"x"), 1)
    assert store.stat("foreign").sha256 is None
    assert store.get("foreign") == b"plain"
    assert [i.key for i in store.list()] == ["foreign"]


def test_config_credentials_endpoint_url_and_uri_resolution(
    s3_server: EmbeddedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(s3_server.secret_key + "\n")
    monkeypatch.setenv("MY_S3_ACCESS", s3_server.access_key)
    config = StoreConfig(
        uri=f"s3://{BUCKET}/cfg-{uuid.uuid4().hex[:8]}",
        endpoint=s3_server.url,
        access_key_env="MY_S3_ACCESS",
        secret_key_file=secret_file,
    )
    with open_store(config) as store:
        assert isinstance(store, S3Store)
        info = store.put("a/b", b"configured")

    # An announced URI is readable by a service that knows only the endpoint and credentials.
    monkeypatch.setenv("DART_S3_ENDPOINT", s3_server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    assert get_by_uri(info.uri) == b"configured"
    reader, key = resolve_uri(info.uri)
    with reader:
        assert isinstance(reader, S3Store) and not reader.create_bucket
        assert key == info.uri.removeprefix(f"s3://{BUCKET}/")
        assert reader.stat(key).sha256 == info.sha256


def test_raw_minio_errors_never_escape(store: S3Store, raw: Minio) -> None:
    store.put("k", b"x")
    raw.remove_object(store.bucket, store.object_name("k"))
    for operation in (lambda: store.get("k"), lambda: store.stat("k"), lambda: store.get_stream("k")):
        with pytest.raises(ArtifactNotFoundError) as exc:
            operation()
        assert isinstance(exc.value.__cause__, S3Error)


def test_reads_by_uri_share_one_bounded_pool_of_clients(store: S3Store, s3_server: EmbeddedS3) -> None:
    from dart.runtime.store import config as store_config

    info = store.put("pooled/x", b"pooled")
    config = StoreConfig(uri=f"s3://{BUCKET}", endpoint=s3_server.url)
    env = {"DART_S3_ACCESS_KEY": s3_server.access_key, "DART_S3_SECRET_KEY": s3_server.secret_key}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        first, key = resolve_uri(info.uri, config)
        with first:  # closing a pooled client keeps it usable for the next caller
            assert first.get(key) == b"pooled"
        second, _ = resolve_uri(info.uri, config)
        assert second is first and second.get(key) == b"pooled"
        assert get_by_uri(info.uri, config=config) == b"pooled"
        # Another bucket is another client; past POOL_SIZE the least recently used one goes.
        others = [resolve_uri(f"s3://other-{i}/k", config)[0] for i in range(store_config.POOL_SIZE)]
        assert len({id(o) for o in others}) == store_config.POOL_SIZE and first not in others
        assert resolve_uri(info.uri, config)[0] is not first and not first.shared
