"""JetStream: idempotent stream and consumer setup, deduplicated publishes, durable pull consumption.

What must not be lost (work items, trajectories, batches, model versions) travels on streams.
Publishers pass a message id, so a retried publish within the stream's duplicate window is stored
once. Consumers are durable pull consumers with explicit acks: a message that is not acked within
``ack_wait`` (its consumer died, or is too slow and did not call ``in_progress``) is redelivered,
up to ``max_deliver`` times. A message that does not decode is terminated and counted, never
redelivered, since no retry can fix it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    Header,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.client import JetStreamContext
from opentelemetry.trace import Span, SpanKind

from dart.protocol.bus.service import Schema
from dart.protocol.bus.stats import BusStats
from dart.protocol.bus.tracing import receive_span, send_span
from dart.protocol.errors import JetStreamError, MessageValidationError
from dart.protocol.messages.base import Message
from dart.protocol.messages.codec import decode, encode

log = logging.getLogger("dart.protocol.bus")

T = TypeVar("T")

Retention = Literal["limits", "interest", "workqueue"]
Storage = Literal["file", "memory"]
Discard = Literal["old", "new"]
DeliverFrom = Literal["all", "new", "last"]
EnsureResult = Literal["created", "updated", "unchanged"]
"""What an ``ensure_*`` call did: created the object, updated its config, or found it as asked."""

_STREAM_NAME_IN_USE = 10058
_CONSUMER_EXISTS = 10148


@dataclass(frozen=True)
class PublishAck:
    """The server's acknowledgement of a persistent publish.

    Attributes:
        stream: Stream that stored the message.
        seq: Its stream sequence number (for a duplicate: the sequence of the original).
        duplicate: True when a message with the same id was already stored within the stream's
            duplicate window, so this publish stored nothing.
    """

    stream: str
    seq: int
    duplicate: bool


def _norm(value: Any) -> Any:
    """Normalize config values for comparison: enums to strings, seconds to milliseconds."""
    if hasattr(value, "value"):
        return str(value.value)
    if isinstance(value, float):
        return round(value * 1000)
    if isinstance(value, list):
        return sorted(_norm(v) for v in value)
    return value


def _diff(desired: Mapping[str, Any], actual: object) -> dict[str, tuple[Any, Any]]:
    return {
        key: (getattr(actual, key, None), want)
        for key, want in desired.items()
        if _norm(getattr(actual, key, None)) != _norm(want)
    }


def _reason(exc: BaseException) -> str:
    if isinstance(exc, nats.js.errors.APIError) and exc.description:
        return f"{exc.description} (err_code {exc.err_code})"
    if isinstance(exc, nats.errors.NoRespondersError | nats.js.errors.ServiceUnavailableError):
        return "JetStream is not answering: is it enabled on the server (nats-server -js)?"
    if isinstance(exc, TimeoutError):
        return "JetStream API timed out"
    return f"{type(exc).__name__}: {exc}"


async def ensure_stream(
    js: JetStreamContext,
    name: str,
    subjects: Sequence[str],
    *,
    retention: Retention = "limits",
    storage: Storage = "file",
    max_age_s: float | None = None,
    duplicate_window_s: float = 120.0,
    max_msgs: int | None = None,
    max_bytes: int | None = None,
    max_msg_size: int | None = None,
    discard: Discard = "old",
    replicas: int = 1,
) -> EnsureResult:
    """Create a stream, or update it when its config differs; a no-op when it already matches.

    Safe to call from every process at start-up, concurrently. ``storage`` and ``retention`` of an
    existing stream cannot change (the server refuses): delete the stream to change them.

    Raises:
        JetStreamError: The server refused the config or JetStream is unavailable.
    """
    desired: dict[str, Any] = {
        "subjects": sorted(subjects),
        "retention": RetentionPolicy(retention),
        "storage": StorageType(storage),
        "max_age": float(max_age_s or 0.0),
        "duplicate_window": float(duplicate_window_s),
        "max_msgs": -1 if max_msgs is None else max_msgs,
        "max_bytes": -1 if max_bytes is None else max_bytes,
        "max_msg_size": -1 if max_msg_size is None else max_msg_size,
        "discard": DiscardPolicy(discard),
        "num_replicas": replicas,
    }
    config = StreamConfig(name=name, **desired)
    try:
        try:
            info = await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            try:
                await js.add_stream(config)
                log.info("created stream %s on %s", name, ", ".join(subjects))
                return "created"
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code != _STREAM_NAME_IN_USE:
                    raise
                # Another process created it between our lookup and create: compare with theirs.
                info = await js.stream_info(name)
        changed = _diff(desired, info.config)
        if not changed:
            return "unchanged"
        await js.update_stream(config)
        log.info("updated stream %s: %s", name, {k: f"{old} -> {new}" for k, (old, new) in changed.items()})
        return "updated"
    except (nats.errors.Error, TimeoutError) as exc:
        raise JetStreamError("ensure_stream", name, _reason(exc)) from exc


async def ensure_consumer(
    js: JetStreamContext,
    stream: str,
    durable: str,
    *,
    ack_wait_s: float = 30.0,
    max_deliver: int = 5,
    max_ack_pending: int = 1000,
    filter_subject: str | None = None,
    deliver_from: DeliverFrom = "all",
    backoff_s: Sequence[float] | None = None,
) -> EnsureResult:
    """Create a durable pull consumer with explicit acks, or update it when its config differs.

    Args:
        js: JetStream context.
        stream: Stream name.
        durable: Durable consumer name; processes using the same name share its messages.
        ack_wait_s: Seconds a delivered message may stay unacked before it is redelivered.
        max_deliver: Deliveries per message before the server gives up on it (``-1``: no limit).
        max_ack_pending: Delivered-but-unacked messages allowed across all members.
        filter_subject: Only messages on this subject (default: every subject of the stream).
        deliver_from: Where a new consumer starts: every stored message, only new ones, or the last.
        backoff_s: Redelivery delays, one per delivery attempt (overrides ``ack_wait_s`` for
            redeliveries).

    Raises:
        JetStreamError: The stream does not exist, the change is not allowed (e.g. ``deliver_from``
            of an existing consumer), or JetStream is unavailable.
    """
    desired: dict[str, Any] = {
        "ack_policy": AckPolicy.EXPLICIT,
        "ack_wait": float(ack_wait_s),
        "max_deliver": max_deliver,
        "max_ack_pending": max_ack_pending,
        "filter_subject": filter_subject,
        "deliver_policy": DeliverPolicy(deliver_from),
        "backoff": [float(b) for b in backoff_s] if backoff_s else None,
    }
    config = ConsumerConfig(name=durable, durable_name=durable, **desired)
    try:
        try:
            info = await js.consumer_info(stream, durable)
        except nats.js.errors.NotFoundError:
            try:
                await js.add_consumer(stream, config)
                return "created"
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code != _CONSUMER_EXISTS:
                    raise
                info = await js.consumer_info(stream, durable)
        changed = _diff(desired, info.config)
        if not changed:
            return "unchanged"
        # Creating with the same name and no action updates the consumer in place.
        await js.add_consumer(stream, config)
        log.info("updated consumer %s/%s: %s", stream, durable, {k: f"{o} -> {n}" for k, (o, n) in changed.items()})
        return "updated"
    except (nats.errors.Error, TimeoutError) as exc:
        raise JetStreamError("ensure_consumer", f"{stream}/{durable}", _reason(exc)) from exc


async def js_publish(
    js: JetStreamContext, subject: str, msg: Message, msg_id: str, *, timeout: float, stream: str | None = None
) -> PublishAck:
    """Persist one message with a dedupe id; see :meth:`Bus.js_publish <dart.protocol.bus.Bus.js_publish>`."""
    if not msg_id:
        raise ValueError("msg_id must be a non-empty id that is the same when the same message is retried")
    data = encode(msg)
    with send_span("publish", subject, SpanKind.PRODUCER) as (span, headers):
        headers[Header.MSG_ID] = msg_id
        span.set_attribute("messaging.message.id", msg_id)
        try:
            ack = await js.publish(subject, data, timeout=timeout, stream=stream, headers=headers)
        except nats.js.errors.NoStreamResponseError as exc:
            raise JetStreamError("js_publish", subject, "no stream stores this subject: ensure_stream first") from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise JetStreamError("js_publish", subject, _reason(exc)) from exc
        return PublishAck(stream=ack.stream, seq=ack.seq, duplicate=bool(ack.duplicate))


class Delivery(Generic[T]):
    """One message delivered by a durable pull consumer, already validated.

    Lifecycle: ``delivered`` -> exactly one of ``ack()`` (done), ``nak()`` (redeliver, optionally
    after a delay), ``term()`` (never redeliver) -> ``settled``. Until settled, ``in_progress()``
    resets the ack timer for long work. An unsettled delivery is redelivered after ``ack_wait``.

    Attributes:
        message: The decoded message.
        subject: Subject it was published to.
        stream: Stream name.
        consumer: Durable consumer name.
        stream_seq: Sequence number in the stream.
        num_delivered: How many times it has been delivered, this delivery included (1 = first).
        headers: Message headers (trace context, ``Nats-Msg-Id``).
    """

    __slots__ = ("_msg", "consumer", "headers", "message", "num_delivered", "stream", "stream_seq", "subject")

    def __init__(self, msg: Msg, message: T) -> None:
        meta = msg.metadata
        self._msg = msg
        self.message = message
        self.subject = msg.subject
        self.stream = meta.stream
        self.consumer = meta.consumer
        self.stream_seq = meta.sequence.stream
        self.num_delivered = meta.num_delivered
        self.headers: Mapping[str, str] = msg.headers or {}

    @property
    def msg_id(self) -> str | None:
        """The publisher's dedupe id, when it set one."""
        return self.headers.get(Header.MSG_ID)

    async def ack(self) -> None:
        """Mark the message processed; it will not be delivered again."""
        await self._settle("ack", self._msg.ack())

    async def nak(self, delay: float | None = None) -> None:
        """Ask for redelivery, after ``delay`` seconds when given (else right away)."""
        await self._settle("nak", self._msg.nak(delay=delay))

    async def in_progress(self) -> None:
        """Reset the ack timer: the work is still going (call it more often than ``ack_wait``)."""
        await self._settle("in_progress", self._msg.in_progress())

    async def term(self) -> None:
        """Give up on the message for good: it will not be redelivered."""
        await self._settle("term", self._msg.term())

    @contextmanager
    def span(self) -> Iterator[Span]:
        """A CONSUMER span, child of the publisher's span, to process this delivery in.

        Example::

            async for delivery in consumer.messages():
                with delivery.span():
                    await handle(delivery.message)
                    await delivery.ack()
        """
        with receive_span("process", self.subject, self.headers, SpanKind.CONSUMER) as span:
            span.set_attribute("messaging.message.delivery_count", self.num_delivered)
            yield span

    async def _settle(self, operation: str, call: Any) -> None:
        try:
            await call
        except nats.errors.Error as exc:
            raise JetStreamError(operation, f"{self.stream}/{self.consumer} seq {self.stream_seq}", str(exc)) from exc


class PullConsumer(Generic[T]):
    """A bound durable pull consumer yielding validated :class:`Delivery` objects.

    Lifecycle: ``bound`` by :meth:`Bus.pull_consumer <dart.protocol.bus.Bus.pull_consumer>` ->
    ``closed`` by :meth:`close` (or the bus closing). Closing stops fetching; deliveries not yet
    acked are redelivered to other members after ``ack_wait``. Several processes (or several
    ``PullConsumer`` objects) bound to the same durable share its messages.

    Attributes:
        stream: Stream name.
        durable: Durable consumer name.
    """

    def __init__(
        self, sub: JetStreamContext.PullSubscription, stream: str, durable: str, schema: Schema, stats: BusStats
    ) -> None:
        self.stream = stream
        self.durable = durable
        self._sub = sub
        self._schema = schema
        self._stats = stats
        self._closed = False

    @property
    def poisoned(self) -> int:
        """Undecodable messages this consumer's durable has terminated on this bus."""
        return self._stats.poison_messages.get(f"{self.stream}/{self.durable}", 0)

    async def fetch(self, n: int = 1, timeout: float = 5.0) -> list[Delivery[T]]:
        """Wait up to ``timeout`` seconds for up to ``n`` messages; an empty list when none came.

        Undecodable messages are terminated, counted and left out, so fewer than ``n`` (or none)
        may be returned even when messages arrived.
        """
        if self._closed:
            raise JetStreamError("fetch", f"{self.stream}/{self.durable}", "consumer is closed")
        try:
            msgs = await self._sub.fetch(n, timeout=timeout)
        except TimeoutError:
            return []
        except nats.errors.Error as exc:
            raise JetStreamError("fetch", f"{self.stream}/{self.durable}", _reason(exc)) from exc
        deliveries = []
        for msg in msgs:
            delivery = await self._validate(msg)
            if delivery is not None:
                deliveries.append(delivery)
        return deliveries

    async def messages(self, batch: int = 1, timeout: float = 5.0) -> AsyncIterator[Delivery[T]]:
        """Yield deliveries until :meth:`close`, fetching up to ``batch`` at a time.

        Every delivery of a fetched batch is already ticking towards ``ack_wait``, so keep
        ``batch`` at 1 for long work and raise it for short handlers.
        """
        while not self._closed:
            for delivery in await self.fetch(batch, timeout):
                yield delivery

    async def close(self) -> None:
        """Stop fetching and drop the subscription. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._sub.unsubscribe()
        except nats.errors.Error as exc:
            log.debug("unsubscribing %s/%s: %s", self.stream, self.durable, exc)

    async def _validate(self, msg: Msg) -> Delivery[T] | None:
        try:
            message: T = decode(msg.data, self._schema)
        except MessageValidationError as exc:
            # A message that cannot decode will not decode on redelivery either: stop it here.
            self._stats.count_poison(self.stream, self.durable)
            log.error("terminating undecodable message on %s (%s/%s): %s", msg.subject, self.stream, self.durable, exc)
            try:
                await msg.term()
            except nats.errors.Error as term_exc:
                log.warning("cannot terminate poison message on %s: %s", msg.subject, term_exc)
            return None
        return Delivery(msg, message)
