"""Typed JetStream key-value buckets (run state, the latest model version).

Values are messages encoded like everything else on the bus and validated on read. Writes return
the key's new revision; :meth:`KeyValueStore.update` is a compare-and-set on that revision, so two
writers racing on the same key cannot silently overwrite each other.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, overload

import nats.errors
import nats.js.errors
from nats.js.api import StorageType
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue
from pydantic import BaseModel, TypeAdapter

from dart.protocol.errors import JetStreamError, MessageValidationError, RevisionConflictError
from dart.protocol.messages.base import Message
from dart.protocol.messages.codec import decode, encode
from dart.runtime.bus.jetstream import Storage

log = logging.getLogger("dart.runtime.bus")

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

KvOperation = Literal["put", "delete", "purge"]


@dataclass(frozen=True)
class KvEntry(Generic[T]):
    """One revision of a key.

    Attributes:
        key: The key.
        value: The decoded value; None for a delete or purge marker.
        revision: The key's revision (its stream sequence); pass it to :meth:`KeyValueStore.update`.
        operation: What this revision did.
    """

    key: str
    value: T | None
    revision: int
    operation: KvOperation


def _operation(raw: str | None) -> KvOperation:
    if raw == "DEL":
        return "delete"
    if raw == "PURGE":
        return "purge"
    return "put"


async def open_bucket(
    js: JetStreamContext,
    bucket: str,
    *,
    history: int,
    ttl_s: float | None,
    storage: Storage,
    replicas: int = 1,
    create: bool = True,
) -> KeyValueStore:
    """Bind to a bucket, creating it (or updating its history, TTL and replicas) as needed; idempotent.
    With ``create`` False it only binds: a missing bucket raises, and its settings are left as they are."""
    try:
        if not create:
            return KeyValueStore(bucket, await js.key_value(bucket))
        try:
            kv = await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                kv = await js.create_key_value(
                    bucket=bucket, history=history, ttl=ttl_s, storage=StorageType(storage), replicas=replicas
                )
                return KeyValueStore(bucket, kv)
            except nats.js.errors.BadRequestError:
                kv = await js.key_value(bucket)  # created concurrently by another process
        status = await kv.status()
        config = status.stream_info.config
        if status.history != history or (status.ttl or 0.0) != (ttl_s or 0.0) or config.num_replicas != replicas:
            await js.update_stream(
                config.evolve(max_msgs_per_subject=history, max_age=ttl_s or 0.0, num_replicas=replicas)
            )
            log.info("updated KV bucket %s: history=%d ttl_s=%s replicas=%d", bucket, history, ttl_s, replicas)
        return KeyValueStore(bucket, kv)
    except (nats.errors.Error, TimeoutError) as exc:
        raise JetStreamError("kv", bucket, f"{type(exc).__name__}: {exc}") from exc


class KeyValueStore:
    """A JetStream KV bucket holding typed messages.

    Obtained from :meth:`Bus.kv <dart.runtime.bus.Bus.kv>`; it stays usable while the bus is
    connected and needs no closing.

    Attributes:
        bucket: Bucket name.
    """

    def __init__(self, bucket: str, kv: KeyValue) -> None:
        self.bucket = bucket
        self._kv = kv

    @overload
    async def get(self, key: str, schema: type[M]) -> M | None: ...
    @overload
    async def get(self, key: str, schema: TypeAdapter[T]) -> T | None: ...
    async def get(self, key: str, schema: type[BaseModel] | TypeAdapter[Any]) -> Any:
        """The key's current value, or None when it does not exist or was deleted.

        Raises:
            MessageValidationError: The stored value does not match ``schema``.
        """
        entry = await self.get_entry(key, schema)
        return None if entry is None else entry.value

    async def get_entry(self, key: str, schema: type[BaseModel] | TypeAdapter[Any]) -> KvEntry[Any] | None:
        """The key's current value with its revision (for :meth:`update`), or None when absent."""
        raw = await self._get(key)
        if raw is None or raw.value is None or raw.revision is None:
            return None
        return KvEntry(key, decode(raw.value, schema), raw.revision, "put")

    async def put(self, key: str, msg: Message) -> int:
        """Set the key's value unconditionally; returns the new revision."""
        return await self.put_raw(key, encode(msg))

    async def create(self, key: str, msg: Message) -> int:
        """Set the key only if it does not exist (or was deleted); returns the revision.

        Raises:
            RevisionConflictError: The key already has a value.
        """
        try:
            return await self._kv.create(key, encode(msg))
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise RevisionConflictError(self.bucket, key, 0) from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise self._error("kv_create", key, exc) from exc

    async def update(self, key: str, msg: Message, revision: int) -> int:
        """Compare-and-set: write only if the key is still at ``revision``; returns the new revision.

        Raises:
            RevisionConflictError: Another writer changed the key since ``revision``.
        """
        try:
            return await self._kv.update(key, encode(msg), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise RevisionConflictError(self.bucket, key, revision) from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise self._error("kv_update", key, exc) from exc

    async def get_raw(self, key: str) -> bytes | None:
        """The key's current bytes, or None when it does not exist or was deleted."""
        raw = await self._get(key)
        return None if raw is None else raw.value

    async def put_raw(self, key: str, value: bytes) -> int:
        """Set the key's bytes unconditionally; returns the new revision."""
        try:
            return await self._kv.put(key, value)
        except (nats.errors.Error, TimeoutError) as exc:
            raise self._error("kv_put", key, exc) from exc

    async def delete(self, key: str) -> None:
        """Delete the key (a delete marker is kept for watchers). Deleting a missing key is a no-op."""
        try:
            await self._kv.delete(key)
        except (nats.errors.Error, TimeoutError) as exc:
            raise self._error("kv_delete", key, exc) from exc

    async def keys(self) -> list[str]:
        """Every key that currently has a value."""
        try:
            return list(await self._kv.keys())
        except nats.js.errors.NoKeysError:
            return []
        except (nats.errors.Error, TimeoutError) as exc:
            raise self._error("kv_keys", ">", exc) from exc

    async def history(self, key: str, schema: type[BaseModel] | TypeAdapter[Any]) -> list[KvEntry[Any]]:
        """Every kept revision of a key, oldest first (up to the bucket's ``history``); [] if none."""
        try:
            raws = await self._kv.history(key)
        except nats.js.errors.NoKeysError:
            return []
        except (nats.errors.Error, TimeoutError) as exc:
            raise self._error("kv_history", key, exc) from exc
        entries: list[KvEntry[Any]] = []
        for raw in raws:
            operation = _operation(raw.operation)
            value = decode(raw.value, schema) if operation == "put" and raw.value is not None else None
            entries.append(KvEntry(raw.key, value, raw.revision or 0, operation))
        return entries

    async def watch(self, schema: type[BaseModel] | TypeAdapter[Any], key: str = ">") -> AsyncIterator[KvEntry[Any]]:
        """Yield the current value of each matching key, then every change, until the caller stops.

        Args:
            schema: What values decode to.
            key: A key or a wildcard pattern (``>`` for every key).

        Values that do not decode are logged and skipped, so one bad writer cannot stop a watcher.
        """
        try:
            watcher = await self._kv.watch(key)
        except (nats.errors.Error, TimeoutError) as exc:
            raise self._error("kv_watch", key, exc) from exc
        try:
            async for raw in watcher:
                # None marks "initial values delivered"; the iteration continues with live updates.
                if raw is None or raw.revision is None:
                    continue
                operation = _operation(raw.operation)
                value: Any = None
                if operation == "put" and raw.value is not None:
                    try:
                        value = decode(raw.value, schema)
                    except MessageValidationError as exc:
                        log.error("skipping undecodable value of %s/%s: %s", self.bucket, raw.key, exc)
                        continue
                yield KvEntry(raw.key, value, raw.revision, operation)
        finally:
            try:
                await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py leaves it unannotated
            except nats.errors.Error as exc:
                log.debug("stopping watcher on %s: %s", self.bucket, exc)

    async def _get(self, key: str) -> KeyValue.Entry | None:
        try:
            return await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        except (nats.errors.Error, TimeoutError) as exc:
            raise self._error("kv_get", key, exc) from exc

    def _error(self, operation: str, key: str, exc: BaseException) -> JetStreamError:
        return JetStreamError(operation, f"{self.bucket}/{key}", f"{type(exc).__name__}: {exc}")
