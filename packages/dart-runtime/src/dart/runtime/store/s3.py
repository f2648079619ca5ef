"""The S3 artifact store, through the ``minio`` SDK (MinIO in the stack, SeaweedFS in tests).

Objects live at ``PREFIX/KEY`` in one bucket. The SHA-256 of each object is user metadata
(``x-amz-meta-sha256``), set in the same request that creates the object, so an object is never
visible without its digest:

- ``put`` and ``put_file`` know the digest before uploading (the bytes are in memory, or the
  file is hashed in a first local pass) and upload once.
- ``put_stream`` with an unknown digest buffers the first part; if the stream ends there it is
  one upload. A longer stream is uploaded (multipart) to a hidden staging key
  ``PREFIX/.dart-staging/UUID`` while hashing, then copied server-side to its key with the digest
  recorded, and the staging object deleted. A crashed process can leave staging objects behind:
  a bucket lifecycle rule on ``.dart-staging/`` cleans them up.

Every SDK and HTTP error is translated into a :class:`~dart.protocol.errors.StoreError` subtype.
"""

from __future__ import annotations

import hashlib
import io
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from email.utils import parsedate_to_datetime
from typing import Any

import urllib3
from minio import Minio
from minio.commonconfig import ComposeSource
from minio.datatypes import Object
from minio.error import InvalidResponseError, MinioException, S3Error, ServerError
from minio.helpers import ObjectWriteResult

from dart.protocol.errors import (
    ArtifactNotFoundError,
    IntegrityError,
    StoreAuthError,
    StoreError,
    StoreUnavailableError,
)
from dart.runtime.store.interface import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PART_SIZE,
    SHA256_METADATA_KEY,
    ArtifactInfo,
    ArtifactStore,
    ArtifactStream,
    BinaryReader,
    HashingReader,
    PrefixedReader,
    check_chunk_size,
    check_part_size,
    check_prefix,
    check_put_args,
)
from dart.runtime.store.uri import RESERVED_PREFIX, is_valid_key, s3_uri, validate_bucket, validate_key

_META_HEADER = "x-amz-meta-"
_STAGING_DIR = f"{RESERVED_PREFIX}staging"
# The SDK's header-dict type: values may also be lists, so a dict[str, str] does not fit it.
_Headers = dict[str, str | list[str] | tuple[str]]
_NOT_FOUND = {"NoSuchKey", "NoSuchObject", "NoSuchVersion", "ResourceNotFound", "NoSuchBucket"}
_AUTH_FAILED = {
    "AccessDenied",
    "SignatureDoesNotMatch",
    "InvalidAccessKeyId",
    "InvalidToken",
    "ExpiredToken",
    "InvalidSecurity",
    "AuthorizationHeaderMalformed",
    "AccountProblem",
}


class S3Store(ArtifactStore):
    """Artifacts as objects in an S3 bucket.

    Args:
        bucket: Bucket name.
        endpoint: ``host:port`` of the S3 API.
        access_key: Access key (read it from the environment or a file; see ``StoreConfig``).
        secret_key: Secret key.
        secure: Use HTTPS.
        region: Bucket region; when None the SDK asks the server once per bucket.
        prefix: Key prefix inside the bucket (no leading or trailing ``/``), e.g. ``run-42``.
        create_bucket: Create the bucket on the first write if it does not exist.
        session_token: Temporary-credential session token, if any.
        part_size: Default multipart part size for :meth:`put_stream`, in bytes.
        connect_timeout_s: TCP/TLS connect timeout, in seconds.
        read_timeout_s: Timeout waiting for response bytes, in seconds.
        max_retries: Retries of a request on connection errors and 5xx answers (with backoff).
    """

    def __init__(
        self,
        bucket: str,
        *,
        endpoint: str,
        access_key: str,
        secret_key: str,
        secure: bool = True,
        region: str | None = None,
        prefix: str = "",
        create_bucket: bool = True,
        session_token: str | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        max_retries: int = 3,
    ) -> None:
        self.bucket = validate_bucket(bucket)
        self.prefix = validate_key(prefix.strip("/")) if prefix.strip("/") else ""
        self.endpoint = endpoint
        self.create_bucket = create_bucket
        self.part_size = check_part_size(part_size, DEFAULT_PART_SIZE)
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
            maxsize=16,
            # The system's CA store (and $SSL_CERT_FILE / $SSL_CERT_DIR), where a private MinIO's
            # CA gets installed, rather than the SDK's default certifi bundle.
            cert_reqs="CERT_REQUIRED",
            retries=urllib3.Retry(total=max_retries, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
        )
        try:
            self._client = Minio(
                endpoint,
                access_key=access_key,
                secret_key=secret_key,
                session_token=session_token,
                secure=secure,
                region=region,
                http_client=self._http,
            )
        except ValueError as exc:
            raise StoreError(f"invalid S3 endpoint {endpoint!r}: {exc} (expected host:port)") from exc
        self._bucket_ready = False
        self._bucket_lock = threading.Lock()
        self.shared = False
        """Set for a store handed out by :func:`~dart.runtime.store.resolve_uri`'s pool:
        :meth:`close` then keeps its connections for the next caller."""

    def __repr__(self) -> str:
        return f"S3Store({self.endpoint!r}, {self.uri_prefix!r})"

    @property
    def client(self) -> Minio:
        """The underlying minio client, for operations this interface does not cover."""
        return self._client

    @property
    def uri_prefix(self) -> str:
        """The store URI: ``s3://bucket`` or ``s3://bucket/prefix``."""
        return s3_uri(self.bucket, self.prefix) if self.prefix else f"s3://{self.bucket}"

    def object_name(self, key: str) -> str:
        """The object name of ``key`` in the bucket (the key under the store's prefix)."""
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str) -> str:
        """``s3://`` URI of ``key``."""
        return s3_uri(self.bucket, self.object_name(key))

    def close(self) -> None:
        """Close pooled connections (a no-op for a :attr:`shared` store)."""
        if not self.shared:
            self._http.clear()

    # -- writes -------------------------------------------------------------------------------

    def put(
        self,
        key: str,
        data: bytes,
        *,
        content_type: str | None = None,
        sha256: bool | str = True,
        metadata: Mapping[str, str] | None = None,
    ) -> ArtifactInfo:
        """Store ``data`` under ``key`` (see :meth:`ArtifactStore.put`)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"put() needs bytes, not {type(data).__name__}; use put_stream() for readers")
        check_put_args(sha256, metadata, content_type)
        if sha256 is not False:
            # The bytes are at hand: hash them first, so a large object is uploaded once (no
            # staging copy) and a wrong expected digest is caught before anything is replaced.
            digest = hashlib.sha256(data).hexdigest()
            if isinstance(sha256, str) and sha256 != digest:
                raise IntegrityError(self.uri(key), sha256, digest)
            sha256 = digest
        return self.put_stream(
            key, io.BytesIO(data), size=len(data), content_type=content_type, sha256=sha256, metadata=metadata
        )

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
        """Stream ``reader`` into ``key`` (see :meth:`ArtifactStore.put_stream` and the module doc)."""
        name = self.object_name(key)
        expected, record, meta, ctype = check_put_args(sha256, metadata, content_type)
        part = check_part_size(part_size, self.part_size)
        if size is not None and size < 0:
            raise ValueError(f"size must be >= 0 or None, got {size}")
        source = HashingReader(reader, hashing=record or expected is not None)
        self._ensure_bucket()
        if expected is None and record:
            # One part's worth tells whether the digest can be known before a single upload.
            head = source.read_exact(part + 1)
            if len(head) <= part:
                self._check_size(key, source, size)
                digest = source.hexdigest()
                result = self._upload(key, name, io.BytesIO(head), len(head), part, ctype, self._headers(digest, meta))
                return self._written(key, result, source.size, digest, ctype, meta)
            staged_reader = PrefixedReader(head, source)
            del head  # the reader owns it now and drops it once sent
            return self._put_staged(key, name, staged_reader, source, size, part, ctype, meta)
        headers = self._headers(expected, meta)
        result = self._upload(key, name, source, size if size is not None else -1, part, ctype, headers)
        try:
            self._check_size(key, source, size)
            if expected is not None and source.hexdigest() != expected:
                raise IntegrityError(self.uri(key), expected, source.hexdigest())
        except StoreError:
            # The object went up with a digest (or size) that its bytes do not match: remove it.
            self._remove(name)
            raise
        return self._written(key, result, source.size, expected, ctype, meta)

    def _put_staged(
        self,
        key: str,
        name: str,
        reader: PrefixedReader,
        source: HashingReader,
        size: int | None,
        part: int,
        ctype: str,
        meta: dict[str, str],
    ) -> ArtifactInfo:
        staging = (
            f"{self.prefix}/{_STAGING_DIR}/{uuid.uuid4().hex}" if self.prefix else f"{_STAGING_DIR}/{uuid.uuid4().hex}"
        )
        try:
            self._upload(key, staging, reader, size if size is not None else -1, part, ctype, {})
            self._check_size(key, source, size)
            # Copying onto the final key with the digest as new metadata is the only way to attach
            # metadata known only after the upload; compose_object handles sources over 5 GiB.
            with self._errors(key, writing=True):
                result = self._client.compose_object(
                    self.bucket,
                    name,
                    [ComposeSource(self.bucket, staging)],
                    metadata={"Content-Type": ctype, **self._headers(source.hexdigest(), meta)},
                )
        finally:
            self._remove(staging)
        return self._written(key, result, source.size, source.hexdigest(), ctype, meta)

    def _written(
        self, key: str, result: ObjectWriteResult, size: int, digest: str | None, ctype: str, meta: dict[str, str]
    ) -> ArtifactInfo:
        # Built from what was sent and the write's answer, saving a HEAD per write. A PUT answer
        # has no Last-Modified; its Date is when the object became visible.
        stamp = result.last_modified
        if stamp is None:
            date = result.http_headers.get("last-modified") or result.http_headers.get("date")
            stamp = parsedate_to_datetime(date) if date else None
        return ArtifactInfo(
            uri=self.uri(key),
            key=key,
            size=size,
            sha256=digest,
            etag=result.etag.strip('"') if result.etag else None,
            modified=stamp,
            content_type=ctype,
            metadata=meta,
        )

    def _upload(
        self, key: str, name: str, data: Any, length: int, part: int, ctype: str, headers: _Headers
    ) -> ObjectWriteResult:
        with self._errors(key, writing=True):
            try:
                # One part in flight at a time: memory stays at about two parts, and a failing
                # reader cannot strand the SDK's upload threads.
                return self._client.put_object(
                    self.bucket,
                    name,
                    data,
                    length,
                    content_type=ctype,
                    metadata=headers,
                    part_size=part,
                    num_parallel_uploads=1,
                )
            except OSError as exc:
                if isinstance(exc, urllib3.exceptions.HTTPError):
                    raise
                if length >= 0 and "not enough data" in str(exc):
                    # The SDK's way of saying a reader with a declared size ran short.
                    raise StoreError(f"stream for {self.uri(key)} ended before size={length} bytes") from exc
                raise StoreError(f"cannot upload {self.uri(key)}: {exc}") from exc

    def _check_size(self, key: str, source: HashingReader, size: int | None) -> None:
        if size is None:
            return
        # With a declared size the SDK stops reading at it; anything left means the size was wrong.
        extra = source.read(1)
        if source.size != size or extra:
            actual = f"more than {size}" if extra else str(source.size)
            raise StoreError(f"stream for {self.uri(key)} yielded {actual} bytes, but size={size} was given")

    @staticmethod
    def _headers(digest: str | None, meta: Mapping[str, str]) -> _Headers:
        headers: _Headers = {}
        if digest is not None:
            headers[_META_HEADER + SHA256_METADATA_KEY] = digest
        headers.update({_META_HEADER + k: v for k, v in meta.items()})
        return headers

    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key (or bucket) is not an error."""
        name = self.object_name(key)
        try:
            with self._errors(key):
                self._client.remove_object(self.bucket, name)
        except ArtifactNotFoundError:
            pass

    def _remove(self, name: str) -> None:
        try:
            with self._errors(None):
                self._client.remove_object(self.bucket, name)
        except StoreError:
            pass  # best effort: the caller is already reporting the real failure

    def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        with self._bucket_lock:
            if self._bucket_ready:
                return
            with self._errors(None, writing=True):
                if not self._client.bucket_exists(self.bucket):
                    if not self.create_bucket:
                        raise StoreError(
                            f"bucket {self.bucket!r} does not exist at {self.endpoint}: create it, or set "
                            "store.create_bucket: true"
                        )
                    try:
                        self._client.make_bucket(self.bucket)
                    except S3Error as exc:
                        # Another writer created it between our check and our create.
                        if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                            raise
            self._bucket_ready = True

    # -- reads --------------------------------------------------------------------------------

    def stat(self, key: str) -> ArtifactInfo:
        """Describe ``key`` (see :meth:`ArtifactStore.stat`)."""
        name = self.object_name(key)
        with self._errors(key):
            obj = self._client.stat_object(self.bucket, name)
        return self._info(key, obj.size, obj.etag, obj.last_modified, obj.metadata or {})

    def get(self, key: str, *, verify: bool = True) -> bytes:
        """Read ``key`` whole (see :meth:`ArtifactStore.get`)."""
        with self.get_stream(key, verify=verify, chunk_size=DEFAULT_CHUNK_SIZE) as stream:
            return b"".join(stream)

    def get_stream(self, key: str, *, verify: bool = True, chunk_size: int = DEFAULT_CHUNK_SIZE) -> ArtifactStream:
        """Open ``key`` for streaming (see :meth:`ArtifactStore.get_stream`)."""
        check_chunk_size(chunk_size)
        name = self.object_name(key)
        with self._errors(key):
            resp = self._client.get_object(self.bucket, name)
        headers = resp.headers
        length = headers.get("content-length")
        info = self._info(
            key,
            int(length) if length is not None else None,
            (headers.get("etag") or "").strip('"') or None,
            headers.get("last-modified"),
            headers,
        )
        return ArtifactStream(info, self._chunks(key, resp, chunk_size), verify=verify)

    def _chunks(self, key: str, resp: Any, chunk_size: int) -> Iterator[bytes]:
        try:
            with self._errors(key):
                # decode_content=False: the stored bytes exactly, even if a writer set an encoding.
                yield from resp.stream(chunk_size, decode_content=False)
        finally:
            resp.close()
            resp.release_conn()

    def list(self, prefix: str = "") -> Iterator[ArtifactInfo]:
        """Iterate over artifacts under ``prefix``, in the server's order (see :meth:`ArtifactStore.list`)."""
        check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        with self._errors(None):
            # include_user_meta is a MinIO extension; servers without it return no metadata and
            # the listing then carries no sha256 (stat() has it).
            objects = self._client.list_objects(
                self.bucket, prefix=base + prefix, recursive=True, include_user_meta=True
            )
            for obj in objects:
                name = obj.object_name or ""
                key = name[len(base) :]
                if obj.is_dir or not name.startswith(base) or not is_valid_key(key):
                    continue  # staging objects and names this store could not have written
                yield self._info_from_listing(key, obj)

    def _info_from_listing(self, key: str, obj: Object) -> ArtifactInfo:
        return self._info(key, obj.size, obj.etag, obj.last_modified, obj.metadata or {})

    def _info(
        self, key: str, size: int | None, etag: str | None, modified: Any, headers: Mapping[str, Any]
    ) -> ArtifactInfo:
        meta: dict[str, str] = {}
        ctype: str | None = None
        for raw_name, value in headers.items():
            name = str(raw_name).lower()
            text = value[0] if isinstance(value, list) and value else str(value)
            if name.startswith(_META_HEADER):
                meta[name[len(_META_HEADER) :]] = text
            elif name == "content-type":
                ctype = text
        if isinstance(modified, str):
            modified = parsedate_to_datetime(modified)
        return ArtifactInfo(
            uri=self.uri(key),
            key=key,
            size=size or 0,
            sha256=meta.pop(SHA256_METADATA_KEY, None),
            etag=etag.strip('"') if etag else None,
            modified=modified,
            content_type=ctype,
            metadata=meta,
        )

    # -- errors -------------------------------------------------------------------------------

    @contextmanager
    def _errors(self, key: str | None, *, writing: bool = False) -> Iterator[None]:
        """Translate SDK and HTTP errors into StoreError subtypes."""
        where = self.uri(key) if key is not None else self.uri_prefix
        try:
            yield
        except S3Error as exc:
            code = exc.code or "Unknown"
            if code in _AUTH_FAILED:
                raise StoreAuthError(self.endpoint, code, exc.message or code) from exc
            if code in _NOT_FOUND:
                if code == "NoSuchBucket" and writing:
                    raise StoreError(
                        f"bucket {self.bucket!r} does not exist at {self.endpoint}: create it, or set "
                        "store.create_bucket: true"
                    ) from exc
                if key is not None:
                    raise ArtifactNotFoundError(where) from exc
                if code == "NoSuchBucket":
                    return  # listing a bucket nobody has written to yet: nothing there
            raise StoreError(f"S3 error on {where}: {code}: {exc.message}") from exc
        except (InvalidResponseError, ServerError) as exc:
            raise StoreError(f"unexpected answer from the S3 server at {self.endpoint} for {where}: {exc}") from exc
        except urllib3.exceptions.HTTPError as exc:
            reason = getattr(exc, "reason", None) or exc
            raise StoreUnavailableError(self.endpoint, str(reason)) from exc
        except MinioException as exc:
            raise StoreError(f"S3 client error on {where}: {exc}") from exc
