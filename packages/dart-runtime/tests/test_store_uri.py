"""Artifact URIs and keys: what parses, what is rejected, and with which message."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

import pytest

from dart.protocol.errors import InvalidURIError, StoreError
from dart.runtime.store.uri import (
    ArtifactURI,
    StoreLocation,
    file_uri,
    is_valid_key,
    parse_store_uri,
    parse_uri,
    s3_uri,
    validate_bucket,
    validate_key,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket/key", ArtifactURI("s3", "bucket", "key")),
        (
            "s3://dart-artifacts/run-1/weights/v3/model.safetensors",
            ArtifactURI("s3", "dart-artifacts", "run-1/weights/v3/model.safetensors"),
        ),
        ("S3://bucket/a b/c?d#e", ArtifactURI("s3", "bucket", "a b/c?d#e")),
        ("s3://my.bucket.v2/x", ArtifactURI("s3", "my.bucket.v2", "x")),
        ("file:///var/lib/dart/a.bin", ArtifactURI("file", "/var/lib/dart", "a.bin")),
        ("file://localhost/var/lib/dart/a.bin", ArtifactURI("file", "/var/lib/dart", "a.bin")),
        ("file:///top.bin", ArtifactURI("file", "/", "top.bin")),
        ("file:///data/with%20space/%E2%9C%93.bin", ArtifactURI("file", "/data/with space", "\u2713.bin")),
    ],
)
def test_parse_uri_accepts(uri: str, expected: ArtifactURI) -> None:
    assert parse_uri(uri) == expected


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("", "not a URI"),
        ("bucket/key", "not a URI"),
        ("/abs/path", "not a URI"),
        ("http://host/key", "unsupported URI scheme 'http'"),
        ("gs://bucket/key", "unsupported URI scheme 'gs'"),
        ("s3://bucket", "has no key"),
        ("s3://bucket/", "has no key"),
        ("s3:///key", "invalid S3 bucket name ''"),
        ("s3://Bucket/key", "invalid S3 bucket name"),
        ("s3://ab/key", "invalid S3 bucket name"),
        ("s3://bucket_x/key", "invalid S3 bucket name"),
        ("s3://203.0.113.7/key", "invalid S3 bucket name"),
        ("s3://bucket/a/../b", "'..' segment"),
        ("s3://bucket/a//b", "empty segment"),
        ("s3://bucket/a/", "ends with '/'"),
        ("s3://bucket/a/./b", "'.' segment"),
        ("s3://bucket/.dart-meta/x", "reserved"),
        ("s3://bucket/a\\b", "backslash"),
        ("s3://bucket/a\nb", "control character"),
        ("file://remote-host/x", "only local files"),
        ("file://", "has no path"),
        ("file:///", "is empty"),
        ("file:///a/../b", "'..' segment"),
        ("file:///a/%2E%2E/b", "'..' segment"),
        ("file:///a//b", "empty segment"),
        ("file:///dir/", "ends with '/'"),
        ("file:///a?b", "query or fragment"),
        ("file:///a%FF", "UTF-8"),
    ],
)
def test_parse_uri_rejects_with_a_clear_message(uri: str, message: str) -> None:
    with pytest.raises(InvalidURIError, match=re.escape(message)):
        parse_uri(uri)


def test_invalid_uri_error_is_a_store_error_and_a_value_error() -> None:
    with pytest.raises(StoreError):
        parse_uri("ftp://x/y")
    with pytest.raises(ValueError):
        parse_uri("ftp://x/y")


def test_parse_uri_rejects_non_strings() -> None:
    with pytest.raises(InvalidURIError, match="must be a str"):
        parse_uri(b"s3://bucket/key")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket", StoreLocation("s3", "bucket", "")),
        ("s3://bucket/", StoreLocation("s3", "bucket", "")),
        ("s3://bucket/run-1", StoreLocation("s3", "bucket", "run-1")),
        ("s3://bucket/a/b/", StoreLocation("s3", "bucket", "a/b")),
        ("file:///var/lib/dart/artifacts", StoreLocation("file", "/var/lib/dart/artifacts")),
        ("file:///var/lib/dart/artifacts/", StoreLocation("file", "/var/lib/dart/artifacts")),
        ("file:///", StoreLocation("file", "/")),
    ],
)
def test_parse_store_uri(uri: str, expected: StoreLocation) -> None:
    assert parse_store_uri(uri) == expected


@pytest.mark.parametrize(
    "uri", ["s3://bucket/a/../b", "s3://BAD/x", "file://host/x", "file:///a/../b", "memory://x", "relative/dir"]
)
def test_parse_store_uri_rejects(uri: str) -> None:
    with pytest.raises(InvalidURIError):
        parse_store_uri(uri)


@pytest.mark.parametrize(
    "key",
    ["a", "a/b/c.safetensors", "weights/v3/model-00001-of-00002.safetensors", ".hidden", "a/..b", "\u00e9t\u00e9"],
)
def test_valid_keys(key: str) -> None:
    assert validate_key(key) == key
    assert is_valid_key(key)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("", "empty"),
        ("/a", "starts with '/'"),
        ("a/", "ends with '/'"),
        ("a//b", "empty segment"),
        ("..", "'..' segment"),
        ("a/../../etc/passwd", "'..' segment"),
        (".", "'.' segment"),
        ("a/.dart-tmp-x", "reserved"),
        ("a\\b", "backslash"),
        ("a\x00b", "control character"),
        ("x" * 1025, "longer than 1024 bytes"),
        ("\u00e9" * 513, "longer than 1024 bytes"),
    ],
)
def test_invalid_keys(key: str, message: str) -> None:
    with pytest.raises(InvalidURIError, match=re.escape(message)):
        validate_key(key)
    assert not is_valid_key(key)


def test_validate_key_rejects_non_strings() -> None:
    with pytest.raises(InvalidURIError, match="must be a str"):
        validate_key(3)  # type: ignore[arg-type]


def test_validate_bucket() -> None:
    assert validate_bucket("dart-artifacts") == "dart-artifacts"
    for bad in ("a", "a" * 64, "-abc", "abc-", "ABC", "a..b", "198.51.100.4"):
        with pytest.raises(InvalidURIError):
            validate_bucket(bad)


def test_formatting_round_trips() -> None:
    for uri in ("s3://bucket/a/b c/d", "file:///data/with%20space/x%23y.bin", "file:///data/a.bin"):
        assert str(parse_uri(uri)) == uri
    assert s3_uri("b-1", "k/x") == "s3://b-1/k/x"
    assert file_uri("/data/a b#c?.bin") == "file:///data/a%20b%23c%3F.bin"
    assert parse_uri(file_uri("/data/a b#c?.bin")).path == PurePosixPath("/data/a b#c?.bin")


def test_file_uri_needs_an_absolute_path() -> None:
    with pytest.raises(InvalidURIError, match="absolute"):
        file_uri("relative/path")


def test_scheme_specific_accessors() -> None:
    s3 = parse_uri("s3://bucket/a/b")
    local = parse_uri("file:///x/y")
    assert s3.bucket == "bucket"
    assert local.path == PurePosixPath("/x/y")
    with pytest.raises(InvalidURIError, match="no bucket"):
        _ = local.bucket
    with pytest.raises(InvalidURIError, match="no local path"):
        _ = s3.path
