"""The artifact store interface shared by every backend.

An artifact is an immutable-by-convention blob (weights, trajectory blobs, screenshots) stored
under a *key* (see :func:`~dart.runtime.store.uri.validate_key`) and addressed across services
by its URI. The interface is synchronous: every call is blocking I/O, so asyncio code calls it
through :func:`asyncio.to_thread` or the ``a*`` wrappers below.

Integrity: on every write the store computes the SHA-256 of the bytes as they stream past and
records it with the object; reads with ``verify=True`` (the default) recompute it and raise
:class:`~dart.protocol.errors.IntegrityError` on a mismatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self, TypeAlias

from pydantic import BaseModel, ConfigDict, Field

from dart.protocol.errors import ArtifactNotFoundError, IntegrityError, InvalidURIError, StoreError
from dart.runtime.store.uri import validate_key

MiB = 1024 * 1024
DEFAULT_CHUNK_SIZE = 1 * MiB
"""Chunk size of streamed reads, in bytes."""
DEFAULT_PART_SIZE = 16 * MiB
"""Part size of streamed writes, in bytes (S3 multipart parts: between 5 MiB and 5 GiB)."""
DEFAULT_CONTENT_TYPE = "application/octet-stream"
SHA256_METADATA_KEY = "sha256"
"""User-metadata key under which the hex SHA-256 digest is recorded (``x-amz-meta-sha256`` on S3)."""
MAX_METADATA_BYTES = 1024
"""Largest total size of user metadata keys and values, in bytes (S3 allows 2 KiB in all)."""

BinaryReader: TypeAlias = IO[bytes] | Iterable[bytes]
"""What :meth:`ArtifactStore.put_stream` reads from: a binary file-like object or an iterable of
byte chunks (a generator, a list, an HTTP response's ``iter_content``)."""

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_META_KEY = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")
_META_VALUE = re.compile(r"^[\x20-\x7e]*$")
_CONTENT_TYPE = re.compile(r"^[\w.+-]+/[\w.+-]+(?:\s*;[\x20-\x7e]*)?$")


class ArtifactInfo(BaseModel):
    """What a store knows about one artifact.

    Returned by :meth:`ArtifactStore.put`, :meth:`~ArtifactStore.stat` and
    :meth:`~ArtifactStore.list`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    uri: str
    """Full URI of the artifact (``s3://BUCKET/PREFIX/KEY`` or ``file:///ROOT/KEY``)."""
    key: str
    """Store-relative key."""
    size: int = Field(ge=0)
    """Size in bytes."""
    sha256: str | None = None
    """Hex SHA-256 recorded at write time; None when written with ``sha256=False`` or by a tool
    that does not record it (and, for S3 listings, when the server does not return metadata)."""
    etag: str | None = None
    """Backend version tag: the S3 ETag, or ``<mtime_ns>-<size>`` in hex for local files."""
    modified: datetime | None = None
    """Last modification time (UTC)."""
    content_type: str | None = None
    """MIME type given at write time."""
    metadata: dict[str, str] = Field(default_factory=dict)
    """User metadata given at write time (without the reserved ``sha256`` entry)."""


class ArtifactStream:
    """An iterator over an artifact's bytes that verifies them and owns the connection or file.

    Use it in a ``with`` block (or call :meth:`close`) when you may stop before the end, so the
    HTTP connection or file is released at once. When verification is on and a digest was
    recorded, the ``next()`` after the last chunk raises
    :class:`~dart.protocol.errors.IntegrityError` instead of ``StopIteration`` on a mismatch.

    Attributes:
        info: The artifact's metadata, read when the stream was opened.
    """

    def __init__(self, info: ArtifactInfo, chunks: Iterator[bytes], *, verify: bool) -> None:
        self.info = info
        self._gen = _verified(chunks, info.uri, info.sha256 if verify else None)

    def __iter__(self) -> ArtifactStream:
        return self

    def __next__(self) -> bytes:
        return next(self._gen)

    def close(self) -> None:
        """Release the underlying file or connection. Idempotent."""
        self._gen.close()

    def __enter__(self) -> ArtifactStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _verified(chunks: Iterator[bytes], uri: str, expected: str | None) -> Generator[bytes, None, None]:
    hasher = hashlib.sha256()
    try:
        for chunk in chunks:
            hasher.update(chunk)
            yield chunk
    finally:
        # Closing the source generator runs its cleanup (file close, HTTP release) even when the
        # consumer stops early.
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    if expected is not None and hasher.hexdigest() != expected:
        raise IntegrityError(uri, expected, hasher.hexdigest())


class ArtifactStore(ABC):
    """A place to put and get artifacts by key; implemented by ``LocalStore`` and ``S3Store``.

    Keys are validated on every call (:func:`~dart.runtime.store.uri.validate_key`); a bad key
    raises :class:`~dart.protocol.errors.InvalidURIError`. A missing key raises
    :class:`~dart.protocol.errors.ArtifactNotFoundError`; every other failure is a
    :class:`~dart.protocol.errors.StoreError` (never a raw SDK or OS exception).

    Writes of one key are atomic for readers on both backends: a reader sees the old artifact or
    the new one, never a partial one. Artifacts are meant to be written once (new versions get
    new keys); overwriting is allowed.

    Stores are thread-safe. Use one as a context manager, or call :meth:`close`, to release
    pooled connections.
    """

    @abstractmethod
    def uri(self, key: str) -> str:
        """The full URI of ``key`` in this store (the key need not exist)."""

    @abstractmethod
    def put(
        self,
        key: str,
        data: bytes,
        *,
        content_type: str | None = None,
        sha256: bool | str = True,
        metadata: Mapping[str, str] | None = None,
    ) -> ArtifactInfo:
        """Store ``data`` under ``key``, replacing what was there.

        Args:
            key: Artifact key.
            data: The bytes to store.
            content_type: MIME type to record; ``application/octet-stream`` when None.
            sha256: True to compute and record the SHA-256; False to record none (reads then
                cannot verify); a hex digest to check the data against (raising
                :class:`~dart.protocol.errors.IntegrityError` and storing nothing on a mismatch)
                and record.
            metadata: User metadata: keys of lowercase letters, digits and ``-``; printable
                ASCII values; at most 1 KiB in all. ``sha256`` is reserved.

        Returns:
            The stored artifact's info.
        """

    @abstractmethod
    def put_stream(
        self,
        key: str,
        reader: BinaryReader,
        *,
        size: int | None = None,
        content_type: str | None = None,
        sha256: bool | str = True,
        metadata: Mapping[str, str] | None = None,
        part_size: int | None = None,
    ) -> ArtifactInfo:
        """Store what ``reader`` yields under ``key``, streaming: memory stays bounded by a few
        parts whatever the artifact's size.

        Args:
            key: Artifact key.
            reader: A binary file-like object or an iterable of byte chunks.
            size: Number of bytes the reader yields, when known (a mismatch raises
                :class:`~dart.protocol.errors.StoreError` and stores nothing).
            content_type: As in :meth:`put`.
            sha256: As in :meth:`put`; a given digest is checked when the stream ends. On a
                mismatch nothing is left under ``key``: the local store keeps the previous
                artifact, S3 loses it (the upload replaced it before the end was reached).
            metadata: As in :meth:`put`.
            part_size: Bytes per uploaded part (S3 multipart; 5 MiB to 5 GiB) or per write.

        Returns:
            The stored artifact's info.
        """

    @abstractmethod
    def get(self, key: str, *, verify: bool = True) -> bytes:
        """Read a whole artifact into memory (use :meth:`get_stream` for large ones).

        Raises:
            ArtifactNotFoundError: No artifact has this key.
            IntegrityError: ``verify`` is on, a digest was recorded, and the bytes do not match it.
        """

    @abstractmethod
    def get_stream(self, key: str, *, verify: bool = True, chunk_size: int = DEFAULT_CHUNK_SIZE) -> ArtifactStream:
        """Open an artifact for streaming in chunks of at most ``chunk_size`` bytes.

        The artifact's existence is checked now (raising ``ArtifactNotFoundError``); integrity is
        checked after the last chunk (see :class:`ArtifactStream`).
        """

    @abstractmethod
    def stat(self, key: str) -> ArtifactInfo:
        """Describe an artifact without reading it.

        Raises:
            ArtifactNotFoundError: No artifact has this key.
        """

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ArtifactInfo]:
        """Iterate over every artifact whose key starts with ``prefix``, recursively.

        ``prefix`` is a plain string prefix as in S3: ``"runs/1"`` matches ``runs/1/a`` and
        ``runs/10/b``; use ``"runs/1/"`` for one "directory". The local store and S3 servers
        that follow the spec (AWS, MinIO) list in key order; SeaweedFS lists directory by
        directory, so sort when order matters. Listing is lazy: memory does not grow with the
        number of artifacts.
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete an artifact. Deleting a missing key is not an error."""

    def exists(self, key: str) -> bool:
        """Whether an artifact has this key."""
        try:
            self.stat(key)
        except ArtifactNotFoundError:
            return False
        return True

    def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        content_type: str | None = None,
        metadata: Mapping[str, str] | None = None,
        part_size: int | None = None,
    ) -> ArtifactInfo:
        """Upload a local file, recording its SHA-256.

        The file is hashed in a first local pass, so the digest is known before the upload
        starts (on S3 this avoids a server-side copy), and checked again while uploading, so a
        file changed mid-upload raises :class:`~dart.protocol.errors.IntegrityError`.
        """
        path = Path(path)
        try:
            digest = _file_sha256(path)
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                return self.put_stream(
                    key,
                    f,
                    size=size,
                    content_type=content_type,
                    sha256=digest,
                    metadata=metadata,
                    part_size=part_size,
                )
        except OSError as exc:
            raise StoreError(f"cannot read {path} to upload it as {key!r}: {exc}") from exc

    def get_to_file(
        self, key: str, path: str | os.PathLike[str], *, verify: bool = True, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> ArtifactInfo:
        """Download an artifact to ``path`` atomically: the file appears complete and verified,
        or not at all (a partial download is removed).

        Returns:
            The artifact's info.
        """
        path = Path(path)
        tmp = path.with_name(f".dart-tmp-{uuid.uuid4().hex}-{path.name}")
        try:
            with self.get_stream(key, verify=verify, chunk_size=chunk_size) as stream, tmp.open("wb") as out:
                for chunk in stream:
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
            return stream.info
        except OSError as exc:
            raise StoreError(f"cannot write {path} while downloading {key!r}: {exc}") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release pooled connections. The store must not be used afterwards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # Thin async wrappers: the I/O runs in the default thread pool so the event loop keeps going.

    async def aput(self, key: str, data: bytes, **kwargs: Any) -> ArtifactInfo:
        """:meth:`put` in a worker thread."""
        return await asyncio.to_thread(self.put, key, data, **kwargs)

    async def aget(self, key: str, *, verify: bool = True) -> bytes:
        """:meth:`get` in a worker thread."""
        return await asyncio.to_thread(self.get, key, verify=verify)

    async def astat(self, key: str) -> ArtifactInfo:
        """:meth:`stat` in a worker thread."""
        return await asyncio.to_thread(self.stat, key)

    async def aexists(self, key: str) -> bool:
        """:meth:`exists` in a worker thread."""
        return await asyncio.to_thread(self.exists, key)

    async def adelete(self, key: str) -> None:
        """:meth:`delete` in a worker thread."""
        await asyncio.to_thread(self.delete, key)

    async def aput_file(self, key: str, path: str | os.PathLike[str], **kwargs: Any) -> ArtifactInfo:
        """:meth:`put_file` in a worker thread."""
        return await asyncio.to_thread(self.put_file, key, path, **kwargs)

    async def aget_to_file(self, key: str, path: str | os.PathLike[str], *, verify: bool = True) -> ArtifactInfo:
        """:meth:`get_to_file` in a worker thread."""
        return await asyncio.to_thread(self.get_to_file, key, path, verify=verify)


class HashingReader:
    """Adapts a :data:`BinaryReader` to ``read(n)``, hashing and counting the bytes that pass.

    Reads copy each byte at most once (chunks are joined, not accumulated in a buffer), since
    the S3 SDK makes copies of its own and memory per upload should stay a few parts.

    Args:
        source: What to read.
        hashing: Whether to hash the bytes (False for a write that records no digest: hashing GBs costs
            about a second per 1.3 GB on one core).

    Attributes:
        size: Bytes read so far.
    """

    def __init__(self, source: BinaryReader, *, hashing: bool = True) -> None:
        self.size = 0
        self._hasher = hashlib.sha256() if hashing else None
        self._file: Callable[[int], Any] | None = None
        self._chunks: Iterator[Any] | None = None
        self._pending: deque[bytes] = deque()
        self._pending_size = 0
        read = getattr(source, "read", None)
        if callable(read):
            self._file = read
        elif isinstance(source, (bytes, bytearray, memoryview, str)):
            # Iterating bytes yields ints: almost certainly a mistake for put().
            raise TypeError("put_stream needs a binary file-like object or an iterable of bytes; use put() for bytes")
        else:
            self._chunks = iter(source)

    def hexdigest(self) -> str:
        """SHA-256 of the bytes read so far.

        Raises:
            RuntimeError: The reader was made with ``hashing=False``.
        """
        if self._hasher is None:
            raise RuntimeError("this reader does not hash (hashing=False)")
        return self._hasher.hexdigest()

    def read(self, n: int = -1) -> bytes:
        """Read up to ``n`` bytes (all that remain when ``n < 0``); ``b""`` at the end."""
        data = self._read_file(n) if self._file is not None else self._read_chunks(n)
        if self._hasher is not None:
            self._hasher.update(data)
        self.size += len(data)
        return data

    def read_exact(self, n: int) -> bytes:
        """Read ``n`` bytes, fewer only at the end of the stream."""
        parts = []
        remaining = n
        while remaining > 0:
            data = self.read(remaining)
            if not data:
                break
            parts.append(data)
            remaining -= len(data)
        return b"".join(parts)

    def _read_file(self, n: int) -> bytes:
        assert self._file is not None
        data = self._file(n)
        if isinstance(data, str):
            raise TypeError("put_stream needs a binary reader; this one returned str (open the file with 'rb')")
        return data if type(data) is bytes else bytes(data or b"")

    def _read_chunks(self, n: int) -> bytes:
        assert self._chunks is not None
        while n < 0 or self._pending_size < n:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            if isinstance(chunk, str):
                raise TypeError("put_stream needs an iterable of bytes; it yielded str")
            if chunk:
                chunk = chunk if type(chunk) is bytes else bytes(chunk)
                self._pending.append(chunk)
                self._pending_size += len(chunk)
        take = self._pending_size if n < 0 else min(n, self._pending_size)
        out = []
        need = take
        while need:
            head = self._pending[0]
            if len(head) <= need:
                out.append(self._pending.popleft())
                need -= len(head)
            else:
                out.append(head[:need])
                self._pending[0] = head[need:]
                need = 0
        self._pending_size -= take
        # join() of a single bytes object returns it without copying.
        return b"".join(out)


class PrefixedReader:
    """A ``read(n)`` source that yields ``head`` first, then the rest of a :class:`HashingReader`."""

    def __init__(self, head: bytes, rest: HashingReader) -> None:
        self._head = head
        self._offset = 0
        self._rest = rest

    def read(self, n: int = -1) -> bytes:
        """Read up to ``n`` bytes."""
        remaining = len(self._head) - self._offset
        if remaining <= 0:
            return self._rest.read(n)
        take = remaining if n < 0 else min(n, remaining)
        if self._offset == 0 and take == remaining:
            data = self._head  # hand over the buffer itself instead of copying it
        else:
            data = self._head[self._offset : self._offset + take]
        self._offset += take
        if self._offset >= len(self._head):
            self._head = b""  # drop the reference: the head should not live as long as the upload
            self._offset = 0
        return data


def check_put_args(
    sha256: bool | str, metadata: Mapping[str, str] | None, content_type: str | None
) -> tuple[str | None, bool, dict[str, str], str]:
    """Validate the common write arguments.

    Returns:
        ``(expected_digest, record_digest, metadata, content_type)``.

    Raises:
        ValueError: A digest, metadata entry or content type is malformed; the message says which.
    """
    expected: str | None = None
    if isinstance(sha256, str):
        if not _HEX64.match(sha256):
            raise ValueError(f"sha256 must be True, False or a 64-char lowercase hex digest, got {sha256!r}")
        expected, record = sha256, True
    elif isinstance(sha256, bool):
        record = sha256
    else:
        raise ValueError(f"sha256 must be a bool or a hex digest, not {type(sha256).__name__}")
    meta = dict(metadata or {})
    total = 0
    for k, v in meta.items():
        if not isinstance(k, str) or not _META_KEY.match(k):
            raise ValueError(
                f"metadata key {k!r} is invalid: use 1-64 lowercase letters, digits and '-' (not at the ends)"
            )
        if k == SHA256_METADATA_KEY:
            raise ValueError("metadata key 'sha256' is reserved: pass the digest as sha256=")
        if not isinstance(v, str) or not _META_VALUE.match(v) or v != v.strip():
            raise ValueError(f"metadata value for {k!r} must be printable ASCII without surrounding spaces, got {v!r}")
        total += len(k) + len(v)
    if total > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {total} bytes; at most {MAX_METADATA_BYTES} are allowed")
    ctype = content_type or DEFAULT_CONTENT_TYPE
    if not _CONTENT_TYPE.match(ctype):
        raise ValueError(f"content_type {ctype!r} is not a MIME type like 'application/json'")
    return expected, record, meta, ctype


def check_part_size(part_size: int | None, default: int) -> int:
    """Validate a part size (S3 limits: 5 MiB to 5 GiB) and apply the default.

    Raises:
        ValueError: The part size is out of range.
    """
    size = default if part_size is None else part_size
    if not 5 * MiB <= size <= 5 * 1024 * MiB:
        raise ValueError(f"part_size must be between 5 MiB and 5 GiB, got {size} bytes")
    return size


def check_chunk_size(chunk_size: int) -> int:
    """Validate a read chunk size.

    Raises:
        ValueError: ``chunk_size`` is not positive.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return chunk_size


def check_prefix(prefix: str) -> str:
    """Validate a listing prefix: ``""``, or complete key segments followed by a partial one.

    Raises:
        InvalidURIError: The prefix could never match a valid key (leading ``/``, ``..``, ...).
    """
    if not isinstance(prefix, str):
        raise InvalidURIError(f"list prefix must be a str, not {type(prefix).__name__}")
    if prefix.startswith("/"):
        raise InvalidURIError(f"list prefix {prefix!r} starts with '/'; keys are relative to the store root")
    complete, _, _partial = prefix.rpartition("/")
    if complete:
        validate_key(complete)
    return prefix


def _file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(DEFAULT_CHUNK_SIZE):
            hasher.update(chunk)
    return hasher.hexdigest()
