"""The JetStream half of :class:`~dart.runtime.bus.Bus`: streams, consumers, persistent publishes, KV.

Kept apart from the core client so each module stays readable; :class:`JetStreamMethods` is a mixin
that only works as a base of ``Bus``, which provides the attributes it declares.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any, TypeVar, cast, get_args, overload

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.client import JetStreamContext
from pydantic import BaseModel, TypeAdapter

from dart.protocol.errors import JetStreamError, MessageValidationError
from dart.protocol.messages.base import Message
from dart.protocol.messages.codec import decode, wire_json
from dart.protocol.subjects import StreamKind, Subjects
from dart.runtime.bus.auth import DenialWatch
from dart.runtime.bus.config import BusConfig
from dart.runtime.bus.consumer import PullConsumer
from dart.runtime.bus.jetstream import (
    ConsumerState,
    DeliverFrom,
    Discard,
    EnsureResult,
    PublishAck,
    Retention,
    Storage,
    StreamCensus,
    StreamState,
    consumer_state,
    ensure_consumer,
    ensure_stream,
    js_publish,
    stream_state,
)
from dart.runtime.bus.kv import KeyValueStore, open_bucket
from dart.runtime.bus.stats import BusStats
from dart.runtime.bus.tracing import BusTracer

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

_STREAM_KINDS: frozenset[str] = frozenset(get_args(StreamKind))

log = logging.getLogger("dart.runtime.bus")


class JetStreamMethods:
    """JetStream operations of a :class:`~dart.runtime.bus.Bus` (see there for the lifecycle)."""

    _nc: NatsClient
    _js: JetStreamContext
    _config: BusConfig
    _subjects: Subjects
    _stats: BusStats
    _tracer: BusTracer
    _consumers: list[PullConsumer[Any]]
    _denials: DenialWatch

    async def ensure_stream(
        self,
        stream: StreamKind | str,
        subjects: Sequence[str] | None = None,
        *,
        retention: Retention = "limits",
        storage: Storage = "file",
        max_age_s: float | None = None,
        duplicate_window_s: float | None = None,
        max_msgs: int | None = None,
        max_bytes: int | None = None,
        max_msg_size: int | None = None,
        discard: Discard = "old",
        replicas: int = 1,
    ) -> EnsureResult:
        """Create or update a stream so that it has exactly this config; a no-op when it does.

        Args:
            stream: A stream kind (``work``, ``traj``, ``batch``, ``model``), named and bound to its
                subject through :attr:`subjects`, or a full stream name (then give ``subjects``).
            subjects: Subjects the stream stores (default for a kind: its stream subject).
            retention: ``limits`` (keep until limits), ``interest`` (until every consumer acked)
                or ``workqueue`` (until one consumer acked).
            storage: ``file`` (survives restarts) or ``memory``.
            max_age_s: Drop messages older than this; None keeps them until other limits hit.
            duplicate_window_s: How long a ``msg_id`` is remembered for deduplication (default
                2 min, or ``max_age_s`` when that is shorter).
            max_msgs: Keep at most this many messages (None: no limit).
            max_bytes: Keep at most this many bytes (None: no limit).
            max_msg_size: Refuse larger messages (None: server limit).
            discard: At a limit, drop the ``old``\\ est messages or refuse ``new`` ones.
            replicas: Copies in a cluster.

        Returns:
            ``created``, ``updated`` or ``unchanged``.

        Raises:
            JetStreamError: The server refused the config (e.g. changing ``storage``) or JetStream
                is not enabled.
        """
        name, stream_subjects = self._resolve_stream(stream, subjects)
        return await ensure_stream(
            self._js,
            name,
            stream_subjects,
            retention=retention,
            storage=storage,
            max_age_s=max_age_s,
            duplicate_window_s=duplicate_window_s,
            max_msgs=max_msgs,
            max_bytes=max_bytes,
            max_msg_size=max_msg_size,
            discard=discard,
            replicas=replicas,
        )

    async def ensure_consumer(
        self,
        stream: StreamKind | str,
        durable: str,
        *,
        ack_wait_s: float = 30.0,
        max_deliver: int = 5,
        max_ack_pending: int = 1000,
        filter_subject: str | None = None,
        deliver_from: DeliverFrom = "all",
        backoff_s: Sequence[float] | None = None,
    ) -> EnsureResult:
        """Create or update a durable pull consumer; see :func:`~dart.runtime.bus.jetstream.ensure_consumer`.

        Args:
            stream: A stream kind or a full stream name.
            durable: Durable name, e.g. ``bus.subjects.consumer_name("work", "runners")``.
            ack_wait_s: Seconds before an unacked delivery is redelivered.
            max_deliver: Deliveries per message before the server gives up on it (``-1``: no limit).
            max_ack_pending: Unacked deliveries allowed at once across all members.
            filter_subject: Only this subject of the stream.
            deliver_from: ``all`` stored messages, only ``new`` ones, or the ``last``.
            backoff_s: Per-attempt redelivery delays.
        """
        return await ensure_consumer(
            self._js,
            self._stream_name(stream),
            durable,
            ack_wait_s=ack_wait_s,
            max_deliver=max_deliver,
            max_ack_pending=max_ack_pending,
            filter_subject=filter_subject,
            deliver_from=deliver_from,
            backoff_s=backoff_s,
        )

    async def js_publish(
        self, subject: str, msg: Message, msg_id: str, *, timeout: float | None = None, stream: str | None = None
    ) -> PublishAck:
        """Store a message on the stream that captures ``subject`` and wait for the server's ack.

        Args:
            subject: A stream subject, e.g. ``bus.subjects.stream_subject("traj")``.
            msg: The message.
            msg_id: Dedupe id (``Nats-Msg-Id``): the same id within the stream's duplicate window is
                stored once, so retrying a publish after a lost ack is safe. Derive it from the
                message's identity (e.g. the trajectory id), not from a random value per attempt.
            timeout: Seconds to wait for the ack (default ``config.request_timeout_s``).
            stream: Expected stream name; the publish fails if another stream captures the subject.

        Returns:
            The stream, sequence and whether the message was a duplicate.

        Raises:
            JetStreamError: No stream stores the subject, or no ack came in time.
            PayloadTooLargeError: The message exceeds ``config.max_message_bytes``.
            PermissionDeniedError: The connection's user may not publish to ``subject``.
        """
        seconds = self._config.request_timeout_s if timeout is None else timeout
        return await self._denials.guard(
            "publish",
            subject,
            js_publish(
                self._js,
                self._tracer,
                subject,
                msg,
                msg_id,
                timeout=seconds,
                stream=stream,
                max_payload=self._config.max_message_bytes,
            ),
        )

    @overload
    async def pull_consumer(self, stream: StreamKind | str, durable: str, message_type: type[M]) -> PullConsumer[M]: ...
    @overload
    async def pull_consumer(
        self, stream: StreamKind | str, durable: str, message_type: TypeAdapter[T]
    ) -> PullConsumer[T]: ...
    async def pull_consumer(
        self, stream: StreamKind | str, durable: str, message_type: type[BaseModel] | TypeAdapter[Any]
    ) -> PullConsumer[Any]:
        """Bind to an existing durable pull consumer (see :meth:`ensure_consumer`).

        Raises:
            JetStreamError: The stream or consumer does not exist.
        """
        name = self._stream_name(stream)
        try:
            await self._js.consumer_info(name, durable)
            sub = await self._js.pull_subscribe_bind(durable=durable, stream=name)
        except (nats.errors.Error, TimeoutError) as exc:
            raise JetStreamError("pull_consumer", f"{name}/{durable}", f"{exc!r}: call ensure_consumer first") from exc
        consumer: PullConsumer[Any] = PullConsumer(sub, name, durable, message_type, self._stats, self._tracer)
        self._consumers.append(consumer)
        return consumer

    async def stream_state(self, stream: StreamKind | str) -> StreamState:
        """Messages stored in a stream (a stream kind or a full name) right now."""
        return await stream_state(self._js, self._stream_name(stream))

    async def census(self, stream: StreamKind | str, id_field: str) -> StreamCensus:
        """Every message stored in a stream, read once: how many, the largest one's size, and how many distinct
        values of the top-level JSON field ``id_field`` they carry (the run summary tells a replayed
        trajectory from a lost one by it).

        Raises:
            JetStreamError: The stream does not exist or a read failed.
        """
        messages = largest = 0
        ids: set[str] = set()
        async for seq, data in self._stored(stream, "census", newest_first=False):
            messages += 1
            largest = max(largest, len(data))
            try:
                ids.add(str(json.loads(wire_json(data))[id_field]))
            except (ValueError, KeyError, TypeError):  # not an object with the field: counts on its own
                ids.add(f"\0seq:{seq}")
        return StreamCensus(messages=messages, largest_bytes=largest, distinct=len(ids))

    async def stored_messages(self, stream: StreamKind | str, schema: type[M]) -> AsyncGenerator[M]:
        """The messages stored in a stream, newest first, read one by one by sequence.

        The caller stops iterating when it has found what it looks for. A message that does not
        decode as ``schema`` is logged and skipped. Reading needs the stream's message-get grant
        (``message_readers`` in :mod:`dart.protocol.topology`).

        Raises:
            JetStreamError: The stream does not exist or a read failed.
        """
        async with contextlib.aclosing(self._stored(stream, "stored_messages", newest_first=True)) as stored:
            async for seq, data in stored:
                try:
                    yield decode(data, schema)
                except MessageValidationError as exc:
                    log.error("skipping undecodable message %d of %s: %s", seq, self._stream_name(stream), exc)

    async def _stored(
        self, stream: StreamKind | str, operation: str, *, newest_first: bool
    ) -> AsyncGenerator[tuple[int, bytes]]:
        """``(sequence, payload)`` of every message stored in a stream now, read one by one (one skipped when
        it was deleted or expired meanwhile).

        Raises:
            JetStreamError: The stream does not exist or a read failed (named as ``operation``).
        """
        name = self._stream_name(stream)
        state = await stream_state(self._js, name)
        seqs = range(state.first_seq, state.last_seq + 1) if state.messages else range(0)
        for seq in reversed(seqs) if newest_first else seqs:
            try:
                msg = await self._js.get_msg(name, seq)
            except nats.js.errors.NotFoundError:
                continue  # deleted or expired since the state was read
            except (nats.errors.Error, TimeoutError) as exc:
                raise JetStreamError(operation, name, f"{exc!r}") from exc
            yield seq, msg.data or b""

    async def consumer_state(self, stream: StreamKind | str, durable: str) -> ConsumerState:
        """Backlog of a durable consumer right now: pending, unacked, redelivered, waiting."""
        return await consumer_state(self._js, self._stream_name(stream), durable)

    async def kv(
        self,
        bucket: str,
        *,
        history: int = 1,
        ttl_s: float | None = None,
        storage: Storage = "file",
        replicas: int = 1,
        create: bool = True,
    ) -> KeyValueStore:
        """Open a KV bucket, creating it (or updating history/TTL) as needed; idempotent.

        Args:
            bucket: Bucket name, e.g. ``bus.subjects.kv_bucket("state")``.
            history: Revisions kept per key (1 to 64).
            ttl_s: Expire values older than this; None keeps them.
            storage: ``file`` or ``memory``.
            replicas: Copies in a cluster.
            create: False only binds to an existing bucket (what a role without the right to create
                or change buckets can do); the settings above are then ignored.

        Raises:
            JetStreamError: The bucket could not be created, changed or (``create`` False) found.
        """
        return await open_bucket(
            self._js, bucket, history=history, ttl_s=ttl_s, storage=storage, replicas=replicas, create=create
        )

    # --- internals ----------------------------------------------------------------------------
    def _stream_name(self, stream: str) -> str:
        return self._subjects.stream_name(cast(StreamKind, stream)) if stream in _STREAM_KINDS else stream

    def _resolve_stream(self, stream: str, subjects: Sequence[str] | None) -> tuple[str, list[str]]:
        if stream in _STREAM_KINDS:
            kind = cast(StreamKind, stream)
            return self._subjects.stream_name(kind), list(subjects or [self._subjects.stream_subject(kind)])
        if not subjects:
            raise ValueError(f"stream {stream!r} is not a stream kind ({sorted(_STREAM_KINDS)}): pass its subjects")
        return stream, list(subjects)
