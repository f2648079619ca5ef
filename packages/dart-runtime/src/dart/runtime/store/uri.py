"""Artifact URIs and keys: parsing, validation and formatting.

Two schemes exist:

- ``s3://BUCKET/KEY``: an object in an S3 bucket. The key is written as is (no percent-encoding),
  as the AWS CLI and MinIO client write it.
- ``file:///ABS/PATH`` (or ``file://localhost/ABS/PATH``): a file on this machine, with the path
  percent-encoded as RFC 8089 says.

A *store URI* names where a store keeps its artifacts (``s3://bucket/prefix`` or
``file:///var/lib/dart/artifacts``); an *artifact URI* names one artifact. Keys are the
store-relative names of artifacts and follow the same rules on every backend, so an artifact can
move between backends unchanged.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal
from urllib.parse import quote, unquote

from dart.protocol.errors import InvalidURIError

Scheme = Literal["s3", "file"]

RESERVED_PREFIX = ".dart-"
"""Key segments starting with this are reserved for the stores' own bookkeeping (sidecar
metadata, temporary and staging files) and are skipped by listings."""

MAX_KEY_BYTES = 1024
"""Longest key in UTF-8 bytes (the S3 limit)."""

# S3 bucket naming rules: 3-63 chars of lowercase letters, digits, dots and hyphens, starting and
# ending with a letter or digit, not shaped like an IP address.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IP_RE = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class ArtifactURI:
    """A parsed artifact URI.

    Attributes:
        scheme: ``"s3"`` or ``"file"``.
        root: For ``s3``, the bucket. For ``file``, the absolute directory holding the file: a file
            URI alone does not say where a store's root was, and the local store keeps an
            artifact's metadata beside it, so any split of the path finds it.
        key: For ``s3``, the object key. For ``file``, the file name.
    """

    scheme: Scheme
    root: str
    key: str

    @property
    def bucket(self) -> str:
        """The bucket of an ``s3`` URI.

        Raises:
            InvalidURIError: The URI is not an ``s3`` URI.
        """
        if self.scheme != "s3":
            raise InvalidURIError(f"{self} has no bucket: it is a {self.scheme} URI")
        return self.root

    @property
    def path(self) -> PurePosixPath:
        """The absolute file path of a ``file`` URI.

        Raises:
            InvalidURIError: The URI is not a ``file`` URI.
        """
        if self.scheme != "file":
            raise InvalidURIError(f"{self} has no local path: it is a {self.scheme} URI")
        return PurePosixPath(self.root) / self.key

    def __str__(self) -> str:
        if self.scheme == "s3":
            return s3_uri(self.root, self.key)
        return file_uri(PurePosixPath(self.root) / self.key)


@dataclass(frozen=True, slots=True)
class StoreLocation:
    """A parsed store URI: where a store keeps its artifacts.

    Attributes:
        scheme: ``"s3"`` or ``"file"``.
        root: The bucket (``s3``) or the absolute root directory (``file``).
        prefix: Key prefix under which the store's keys live (``s3`` only; ``""`` for none). It
            never starts or ends with ``/``.
    """

    scheme: Scheme
    root: str
    prefix: str = ""


def validate_key(key: str) -> str:
    """Check that ``key`` is a valid artifact key and return it.

    A key is a ``/``-separated relative path: not empty, no leading or trailing ``/``, no empty,
    ``.`` or ``..`` segments, no segment starting with ``.dart-`` (reserved), no backslashes or
    control characters, at most 1024 UTF-8 bytes.

    Raises:
        InvalidURIError: The key breaks one of these rules; the message says which.
    """
    if not isinstance(key, str):
        raise InvalidURIError(f"artifact key must be a str, not {type(key).__name__}")
    problem = _key_problem(key)
    if problem:
        raise InvalidURIError(f"invalid artifact key {key!r}: {problem}")
    return key


def _key_problem(key: str) -> str | None:
    if not key:
        return "it is empty"
    if key.startswith("/"):
        return "it starts with '/'; keys are relative to the store root"
    if key.endswith("/"):
        return "it ends with '/'; keys name objects, not directories"
    if len(key.encode()) > MAX_KEY_BYTES:
        return f"it is longer than {MAX_KEY_BYTES} bytes"
    if "\\" in key:
        return "it contains a backslash; use '/' to separate segments"
    if _CONTROL_RE.search(key):
        return "it contains a control character"
    for segment in key.split("/"):
        if segment == "":
            return "it has an empty segment ('//')"
        if segment in (".", ".."):
            return f"it has a '{segment}' segment"
        if segment.startswith(RESERVED_PREFIX):
            return f"segment {segment!r} starts with the reserved '{RESERVED_PREFIX}'"
    return None


def is_valid_key(key: str) -> bool:
    """Whether ``key`` passes :func:`validate_key`."""
    return _key_problem(key) is None


def validate_bucket(bucket: str) -> str:
    """Check that ``bucket`` follows the S3 bucket naming rules and return it.

    Raises:
        InvalidURIError: The name is not a valid bucket name.
    """
    if not _BUCKET_RE.match(bucket) or ".." in bucket or _IP_RE.match(bucket):
        raise InvalidURIError(
            f"invalid S3 bucket name {bucket!r}: use 3-63 lowercase letters, digits, '.' and '-', "
            "starting and ending with a letter or digit"
        )
    return bucket


def parse_uri(uri: str) -> ArtifactURI:
    """Parse an artifact URI (``s3://bucket/key`` or ``file:///abs/path``).

    Raises:
        InvalidURIError: The URI is malformed, uses another scheme, or its key is invalid.
    """
    scheme, rest = _split_scheme(uri)
    if scheme == "s3":
        bucket, _, key = rest.partition("/")
        if not key:
            raise InvalidURIError(f"artifact URI {uri!r} has no key: expected s3://BUCKET/KEY")
        return ArtifactURI("s3", validate_bucket(bucket), _checked_key(uri, key))
    path = _file_path(uri, rest, allow_root=False)
    return ArtifactURI("file", str(path.parent), path.name)


def parse_store_uri(uri: str) -> StoreLocation:
    """Parse a store URI (``s3://bucket[/prefix]`` or ``file:///abs/dir``).

    Raises:
        InvalidURIError: The URI is malformed, uses another scheme, or its prefix is invalid.
    """
    scheme, rest = _split_scheme(uri)
    if scheme == "s3":
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if prefix:
            _checked_key(uri, prefix)
        return StoreLocation("s3", validate_bucket(bucket), prefix)
    path = _file_path(uri, rest, allow_root=True)
    return StoreLocation("file", str(path))


def key_in(location: StoreLocation, uri: str) -> str | None:
    """The key of artifact ``uri`` in the store at ``location``, or None when it lies anywhere else.

    The URI is parsed first (so no ``..`` or empty segment can climb out), then compared by scheme, bucket
    and prefix (``s3``) or by directory (``file``).

    Raises:
        InvalidURIError: ``uri`` is malformed.
    """
    parsed = parse_uri(uri)
    if parsed.scheme != location.scheme:
        return None
    if parsed.scheme == "s3":
        if parsed.root != location.root:
            return None
        if not location.prefix:
            return parsed.key
        head = location.prefix + "/"
        return parsed.key[len(head) :] if parsed.key.startswith(head) else None
    path, root = parsed.path, PurePosixPath(location.root)
    return str(path.relative_to(root)) if path.is_relative_to(root) and path != root else None


def s3_uri(bucket: str, key: str) -> str:
    """Format ``s3://bucket/key``."""
    return f"s3://{bucket}/{key}"


def file_uri(path: str | os.PathLike[str]) -> str:
    """Format the ``file://`` URI of an absolute path, percent-encoding what needs it.

    Raises:
        InvalidURIError: The path is not absolute.
    """
    path = PurePosixPath(os.fspath(path))
    if not path.is_absolute():
        raise InvalidURIError(f"file URIs need an absolute path, got {str(path)!r}")
    return "file://" + quote(str(path), safe="/")


def _split_scheme(uri: str) -> tuple[Scheme, str]:
    if not isinstance(uri, str):
        raise InvalidURIError(f"URI must be a str, not {type(uri).__name__}")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        raise InvalidURIError(f"{uri!r} is not a URI: expected s3://BUCKET/KEY or file:///ABSOLUTE/PATH")
    scheme = scheme.lower()
    if scheme == "s3":
        return "s3", rest
    if scheme == "file":
        return "file", rest
    raise InvalidURIError(f"unsupported URI scheme {scheme!r} in {uri!r}: use s3:// or file://")


def _file_path(uri: str, rest: str, *, allow_root: bool) -> PurePosixPath:
    authority, slash, path = rest.partition("/")
    if authority not in ("", "localhost"):
        raise InvalidURIError(
            f"file URI {uri!r} names host {authority!r}: only local files are supported (file:///ABSOLUTE/PATH)"
        )
    if not slash:
        raise InvalidURIError(f"file URI {uri!r} has no path: expected file:///ABSOLUTE/PATH")
    if "?" in path or "#" in path:
        raise InvalidURIError(f"file URI {uri!r} has a query or fragment; percent-encode '?' and '#' in paths")
    try:
        decoded = unquote(path, errors="strict")
    except UnicodeDecodeError as exc:
        raise InvalidURIError(f"file URI {uri!r} does not percent-decode to UTF-8") from exc
    # Validate the path as written: PurePosixPath would silently drop '.' and '//' segments.
    relative = decoded.rstrip("/") if allow_root else decoded
    if relative or not allow_root:
        _checked_key(uri, relative)
    return PurePosixPath("/" + relative)


def _checked_key(uri: str, key: str) -> str:
    problem = _key_problem(key)
    if problem:
        raise InvalidURIError(f"invalid artifact URI {uri!r}: the path {key!r} is not a valid key: {problem}")
    return key
