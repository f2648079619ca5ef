"""The local-directory artifact store (``file://``), the embedded default.

Layout under the root: each artifact is a plain file at ``ROOT/KEY`` (so a weights file can be
opened by path directly), and its metadata is a JSON sidecar in a hidden directory beside it::

    ROOT/weights/v3/model.safetensors
    ROOT/weights/v3/.dart-meta/model.safetensors.json

    {"version": 1, "sha256": "9f86...", "size": 1234, "mtime_ns": 1700000000000000000,
     "content_type": "application/octet-stream", "metadata": {"policy-version": "3"}}

The sidecar sits beside the file, not under the root, so the metadata is found from the file's
URI alone (:func:`~dart.runtime.store.uri.parse_uri` cannot know where a store's root was).
Files put under the root by other tools are artifacts too, with no recorded digest.

Writes are atomic: bytes go to a hidden temporary file in the target directory, are fsynced, and
``os.replace`` moves them into place; the sidecar is replaced just before the file, so a new
artifact is never visible without its digest. The sidecar records the inode, size and mtime of the
file it was written for (``os.replace`` keeps all three), and an overwrite's sidecar also keeps the
record of the file it replaces (``"previous"``): a reader that opens the old file between the two
renames, or after a writer died between them, finds the record of the file it holds, whatever the
timing. When no record describes the file it opened, a reader looks again for as long as the sidecar
changes between its reads (overwrites are going on, however long the reader itself was kept off a
CPU), and briefly while the sidecar is fresh (writers of one key at the same moment are not
serialized, and one may be between its renames). A file changed in place fails verification with
``IntegrityError``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from dart.protocol.errors import ArtifactNotFoundError, IntegrityError, StoreError
from dart.runtime.retry import Backoff
from dart.runtime.store.interface import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PART_SIZE,
    ArtifactInfo,
    ArtifactStore,
    ArtifactStream,
    BinaryReader,
    HashingReader,
    check_chunk_size,
    check_part_size,
    check_prefix,
    check_put_args,
)
from dart.runtime.store.uri import RESERVED_PREFIX, file_uri, is_valid_key, validate_key

META_DIR = ".dart-meta"
"""Name of the hidden directory holding sidecar metadata files."""
_TMP_PREFIX = ".dart-tmp-"
_SIDECAR_VERSION = 1
# A reader that finds a sidecar describing another version of the file, and the same sidecar when it
# reads it again (a writer may be between its two renames), waits at most this long for the file to
# catch up, and only while the sidecar is this fresh: an old mismatch means the file was changed
# outside the store, not a write. A sidecar that changed between the reader's two reads always means
# overwrites in progress, and the reader looks again however long that takes.
_RACE_WAIT_S = 0.25
_FRESH_NS = 5_000_000_000


class LocalStore(ArtifactStore):
    """Artifacts as files under a root directory.

    Args:
        root: The root directory; created when missing.
        fsync: Flush files and directories to disk before a write returns (durable across power
            loss). Turn off only for throwaway data, e.g. in tests.
        create: Create ``root`` when missing (off for read-only use, e.g. resolving a URI).

    Raises:
        StoreError: ``root`` exists and is not a directory, or cannot be created.
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True, create: bool = True) -> None:
        self.root = Path(root).absolute()
        self.fsync = fsync
        if not create:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot use {self.root} as an artifact store root: {exc}") from exc

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """The file path of ``key`` (which need not exist)."""
        return self.root / validate_key(key)

    def uri(self, key: str) -> str:
        """``file://`` URI of ``key``."""
        return file_uri(self.path(key))

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
        return self.put_stream(
            key, [bytes(data)], size=len(data), content_type=content_type, sha256=sha256, metadata=metadata
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
        """Stream ``reader`` into ``key`` (see :meth:`ArtifactStore.put_stream`)."""
        path = self.path(key)
        expected, record, meta, ctype = check_put_args(sha256, metadata, content_type)
        chunk = check_part_size(part_size, DEFAULT_PART_SIZE)
        source = HashingReader(reader, hashing=record or expected is not None)
        uri = file_uri(path)
        tmp = path.with_name(f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        sidecar_tmp: Path | None = None
        try:
            with self._create(key, path.parent, tmp, "xb") as out:
                while data := source.read(chunk):
                    out.write(data)
                self._flush(out)
            digest = source.hexdigest() if record or expected is not None else None
            # os.replace keeps inode and mtime: readers use these to tell which file version the
            # sidecar was written for.
            written = tmp.stat()
            if size is not None and source.size != size:
                raise StoreError(f"stream for {uri} yielded {source.size} bytes, but size={size} was given")
            if expected is not None:
                assert digest is not None  # hashed whenever a digest is expected
                if digest != expected:
                    raise IntegrityError(uri, expected, digest)
            record_doc = {
                "version": _SIDECAR_VERSION,
                "sha256": digest if record else None,
                "ino": written.st_ino,
                "size": written.st_size,
                "mtime_ns": written.st_mtime_ns,
                "content_type": ctype,
                "metadata": meta,
            }
            sidecar = _sidecar(path)
            sidecar_tmp = sidecar.with_name(f"{_TMP_PREFIX}{uuid.uuid4().hex}")
            with self._create(key, sidecar.parent, sidecar_tmp, "x") as f:
                json.dump(_with_previous(record_doc, path), f)
                self._flush(f)
            # Sidecar first: a new artifact must never be visible without its digest.
            os.replace(sidecar_tmp, sidecar)
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(sidecar.parent)
                _fsync_dir(path.parent)
        except OSError as exc:
            raise StoreError(f"cannot write {uri}: {exc}") from exc
        finally:
            for leftover in (tmp, sidecar_tmp):
                if leftover is not None:
                    with contextlib.suppress(OSError):
                        leftover.unlink()
        return self._info(key, path, written, record_doc)

    def _create(self, key: str, directory: Path, file: Path, mode: str) -> IO[Any]:
        """Create ``file`` exclusively in ``directory``, making the directory as needed."""
        if (self.root / key).is_dir():
            raise StoreError(f"cannot store {key!r} in {self.root}: keys under {key + '/'!r} exist")
        for attempt in range(3):
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError) as exc:
                # A key "a/b" cannot coexist with a key "a" on a file system (it can on S3).
                raise StoreError(
                    f"cannot store {key!r} in {self.root}: a parent of it is an existing artifact (file)"
                ) from exc
            try:
                return file.open(mode)
            except FileNotFoundError:
                # A concurrent delete pruned the directory between mkdir and open: make it again.
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _flush(self, f: Any) -> None:
        if self.fsync:
            f.flush()
            os.fsync(f.fileno())

    def delete(self, key: str) -> None:
        """Delete ``key`` and its metadata; a missing key is not an error."""
        path = self.path(key)
        sidecar = _sidecar(path)
        try:
            # The file first: once it is gone the artifact is gone, whatever happens to the sidecar.
            for victim in (path, sidecar):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    victim.unlink()
        except IsADirectoryError:
            return  # "key" is a directory of other keys, not an artifact
        except OSError as exc:
            raise StoreError(f"cannot delete {file_uri(path)}: {exc}") from exc
        self._prune_empty_dirs(sidecar.parent)

    def _prune_empty_dirs(self, start: Path) -> None:
        # Keep the tree tidy, as S3 has no directories: remove emptied ones up to the root.
        current = start
        while current != self.root and self.root in current.parents:
            try:
                current.rmdir()
            except OSError:
                if current.name != META_DIR:
                    return
            current = current.parent

    # -- reads --------------------------------------------------------------------------------

    def stat(self, key: str) -> ArtifactInfo:
        """Describe ``key`` (see :meth:`ArtifactStore.stat`)."""
        path = self.path(key)
        st = self._stat_file(path)
        return self._info(key, path, st, _record_for(_read_sidecar(path)[0], st) or {})

    def get(self, key: str, *, verify: bool = True) -> bytes:
        """Read ``key`` whole (see :meth:`ArtifactStore.get`)."""
        path = self.path(key)
        f, _, record = self._open(path)
        with f:
            try:
                data = f.read()
            except OSError as exc:
                raise StoreError(f"cannot read {file_uri(path)}: {exc}") from exc
        expected = record.get("sha256") if verify else None
        if expected is not None:
            actual = hashlib.sha256(data).hexdigest()
            if actual != expected:
                raise IntegrityError(file_uri(path), expected, actual)
        return data

    def get_stream(self, key: str, *, verify: bool = True, chunk_size: int = DEFAULT_CHUNK_SIZE) -> ArtifactStream:
        """Open ``key`` for streaming (see :meth:`ArtifactStore.get_stream`)."""
        check_chunk_size(chunk_size)
        path = self.path(key)
        f, st, record = self._open(path)
        info = self._info(key, path, st, record)
        return ArtifactStream(info, _file_chunks(f, chunk_size, info.uri), verify=verify)

    def _open(self, path: Path) -> tuple[IO[bytes], os.stat_result, dict[str, Any]]:
        """Open the file of an artifact together with the sidecar written for that very file."""
        deadline = time.monotonic() + _RACE_WAIT_S
        delays = Backoff(0.001, max_s=0.05).delays()
        while True:
            doc, sidecar_mtime_ns = _read_sidecar(path)
            try:
                f = path.open("rb")
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
                raise ArtifactNotFoundError(file_uri(path)) from exc
            except OSError as exc:
                raise StoreError(f"cannot read {file_uri(path)}: {exc}") from exc
            st = os.fstat(f.fileno())
            record = _record_for(doc, st)
            if record is not None:
                return f, st, record
            # No record describes the file. If the sidecar changed meanwhile, overwrites of this key
            # are going on: look again (a reader kept off the CPU for a while is no reason to give up).
            # If it was written moments ago, a writer may be between its renames: look again, briefly.
            # Otherwise the file was changed outside the store, and verification will judge it.
            if _read_sidecar(path)[0] != doc:
                deadline = time.monotonic() + _RACE_WAIT_S
            elif time.monotonic() >= deadline or not (
                sidecar_mtime_ns is not None and time.time_ns() - sidecar_mtime_ns < _FRESH_NS
            ):
                return f, st, doc
            f.close()
            time.sleep(next(delays))

    def list(self, prefix: str = "") -> Iterator[ArtifactInfo]:
        """Iterate over artifacts under ``prefix``, in key order (see :meth:`ArtifactStore.list`)."""
        check_prefix(prefix)
        start_key = prefix.rpartition("/")[0]
        start = self.root / start_key if start_key else self.root
        for key, path in self._walk(start, start_key, prefix):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # deleted while listing
            yield self._info(key, path, st, _record_for(_read_sidecar(path)[0], st) or {})

    def _walk(self, directory: Path, dir_key: str, prefix: str) -> Iterator[tuple[str, Path]]:
        try:
            with os.scandir(directory) as it:
                entries = [e for e in it if not e.name.startswith(RESERVED_PREFIX)]
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise StoreError(f"cannot list {file_uri(directory)}: {exc}") from exc
        # Sorting directories as "name/" yields keys in plain string order, the order S3 lists in.
        is_dir = {e.name: e.is_dir(follow_symlinks=False) for e in entries}
        for entry in sorted(entries, key=lambda e: e.name + "/" if is_dir[e.name] else e.name):
            key = f"{dir_key}/{entry.name}" if dir_key else entry.name
            if is_dir[entry.name]:
                if (key + "/").startswith(prefix) or prefix.startswith(key + "/"):
                    yield from self._walk(Path(entry.path), key, prefix)
            elif key.startswith(prefix) and entry.is_file() and is_valid_key(key):
                yield key, Path(entry.path)

    def _stat_file(self, path: Path) -> os.stat_result:
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ArtifactNotFoundError(file_uri(path)) from exc
        except OSError as exc:
            raise StoreError(f"cannot stat {file_uri(path)}: {exc}") from exc
        if not path.is_file():
            raise ArtifactNotFoundError(file_uri(path))
        return st

    def _info(self, key: str, path: Path, st: os.stat_result, record: Mapping[str, Any]) -> ArtifactInfo:
        return ArtifactInfo(
            uri=file_uri(path),
            key=key,
            size=st.st_size,
            sha256=record.get("sha256"),
            etag=f"{st.st_mtime_ns:x}-{st.st_size:x}",
            modified=datetime.fromtimestamp(st.st_mtime, UTC),
            content_type=record.get("content_type"),
            metadata=dict(record.get("metadata") or {}),
        )


def _sidecar(path: Path) -> Path:
    return path.parent / META_DIR / f"{path.name}.json"


def _read_sidecar(path: Path) -> tuple[dict[str, Any], int | None]:
    """The sidecar of ``path`` and its mtime, or ``({}, None)`` for a file written by another tool."""
    sidecar = _sidecar(path)
    try:
        with sidecar.open() as f:
            mtime_ns = os.fstat(f.fileno()).st_mtime_ns
            doc = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return {}, None
    except (OSError, ValueError) as exc:
        raise StoreError(f"metadata of {file_uri(path)} is unreadable ({sidecar}): {exc}") from exc
    if not isinstance(doc, dict):
        raise StoreError(f"metadata of {file_uri(path)} is not a JSON object ({sidecar})")
    return doc, mtime_ns


def _record_for(doc: Mapping[str, Any], st: os.stat_result) -> dict[str, Any] | None:
    """The record of a sidecar ``doc`` that was written for the file version with stat ``st``.

    That is the sidecar's own record or, between an overwrite's two renames, the record of the
    file it replaces; None when neither describes the file.
    """
    if "size" not in doc or "mtime_ns" not in doc:
        return dict(doc)  # no sidecar (a file put there by another tool): nothing to match
    for record in (doc, doc.get("previous")):
        if (
            isinstance(record, dict)
            and (record.get("size"), record.get("mtime_ns")) == (st.st_size, st.st_mtime_ns)
            # Two writes of one size within a tick of the file system's clock share an mtime: the
            # inode tells them apart (sidecars written before it was recorded match without it).
            and record.get("ino", st.st_ino) == st.st_ino
        ):
            return {k: v for k, v in record.items() if k != "previous"}
    return None


def _with_previous(record: dict[str, Any], path: Path) -> dict[str, Any]:
    """``record`` with the record of the file at ``path`` it is about to replace, if any."""
    try:
        current = _read_sidecar(path)[0]
        st = path.stat()
    except (StoreError, OSError):
        return record  # nothing there, or nothing usable: the new record stands alone
    previous = _record_for(current, st)
    if previous is None or "size" not in previous:
        return record
    return dict(record, previous=previous)


def _file_chunks(f: Any, chunk_size: int, uri: str) -> Iterator[bytes]:
    try:
        while chunk := f.read(chunk_size):
            yield chunk
    except OSError as exc:
        raise StoreError(f"cannot read {uri}: {exc}") from exc
    finally:
        f.close()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems cannot fsync a directory; the data itself is already flushed.
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)
