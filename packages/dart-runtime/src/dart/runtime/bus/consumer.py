"""Durable pull consumption: validated deliveries, explicit settlement, poison handling.

A message that does not decode is terminated and counted, never redelivered, since no retry can
fix it; everything else is redelivered by the server until acked or out of ``max_deliver``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Generic, TypeVar, cast

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import Header
from nats.js.client import JetStreamContext
from opentelemetry.trace import Span, SpanKind

from dart.protocol.errors import JetStreamError, MessageValidationError
from dart.protocol.messages.codec import decode
from dart.runtime.bus.jetstream import reason
from dart.runtime.bus.service import Schema
from dart.runtime.bus.stats import BusStats
from dart.runtime.bus.tracing import BusTracer

log = logging.getLogger("dart.runtime.bus")

T = TypeVar("T")


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

    __slots__ = (
        "_msg",
        "_tracer",
        "consumer",
        "headers",
        "message",
        "num_delivered",
        "stream",
        "stream_seq",
        "subject",
    )

    def __init__(self, msg: Msg, message: T, tracer: BusTracer) -> None:
        meta = msg.metadata
        self._msg = msg
        self._tracer = tracer
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
        with self._tracer.receive("process", self.subject, self.headers, SpanKind.CONSUMER) as span:
            span.set_attribute("messaging.message.delivery_count", self.num_delivered)
            yield span

    async def _settle(self, operation: str, call: Awaitable[None]) -> None:
        try:
            await call
        except nats.errors.Error as exc:
            raise JetStreamError(operation, f"{self.stream}/{self.consumer} seq {self.stream_seq}", str(exc)) from exc


class PullConsumer(Generic[T]):
    """A bound durable pull consumer yielding validated :class:`Delivery` objects.

    Lifecycle: ``bound`` by :meth:`Bus.pull_consumer <dart.runtime.bus.Bus.pull_consumer>` ->
    ``closed`` by :meth:`close` (or the bus closing). Closing stops fetching; deliveries not yet
    acked are redelivered to other members after ``ack_wait``. Several processes (or several
    ``PullConsumer`` objects) bound to the same durable share its messages.

    Attributes:
        stream: Stream name.
        durable: Durable consumer name.
        on_undecodable: Called as ``await on_undecodable(stream_seq, error)`` for each undecodable
            message before it is terminated (the owner records it: nothing is dropped silently);
            None only counts and logs it.
    """

    def __init__(
        self,
        sub: JetStreamContext.PullSubscription,
        stream: str,
        durable: str,
        schema: Schema,
        stats: BusStats,
        tracer: BusTracer,
    ) -> None:
        self.stream = stream
        self.durable = durable
        self._sub = sub
        self._schema = schema
        self._stats = stats
        self._tracer = tracer
        self._closed = False
        self.on_undecodable: Callable[[int, MessageValidationError], Awaitable[None]] | None = None

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
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            msgs = await self._sub.fetch(n, timeout=timeout)
        except TimeoutError:
            msgs = []
        except nats.errors.Error as exc:
            raise JetStreamError("fetch", f"{self.stream}/{self.durable}", reason(exc)) from exc
        if task is not None and task.cancelling() > cancels:
            # nats-py waits for messages with asyncio.wait_for, which on Python 3.11 returns a message
            # that arrives with a cancellation (or times out) instead of raising it: a loop around this
            # fetch would never end. Raise the cancellation; what came is handed back at once.
            for msg in msgs:
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak()
            raise asyncio.CancelledError
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
            deliveries = await self.fetch(batch, timeout)
            for index, delivery in enumerate(deliveries):
                if self._closed:
                    # Closed mid-batch: hand the rest back now rather than after ack_wait.
                    for unsent in deliveries[index:]:
                        await unsent.nak()
                    return
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
            message = cast(T, decode(msg.data, self._schema))
        except MessageValidationError as exc:
            # A message that cannot decode will not decode on redelivery either: stop it here.
            self._stats.count_poison(self.stream, self.durable)
            log.error("terminating undecodable message on %s (%s/%s): %s", msg.subject, self.stream, self.durable, exc)
            if self.on_undecodable is not None:
                try:
                    await self.on_undecodable(msg.metadata.sequence.stream, exc)
                except Exception:
                    # Not recorded: have it redelivered to record it then, rather than lose it unrecorded.
                    log.exception("recording the undecodable message on %s failed; asking for redelivery", msg.subject)
                    try:
                        await msg.nak(delay=1.0)
                    except nats.errors.Error as nak_exc:
                        log.warning("cannot nak the undecodable message on %s: %s", msg.subject, nak_exc)
                    return None
            try:
                await msg.term()
            except nats.errors.Error as term_exc:
                log.warning("cannot terminate poison message on %s: %s", msg.subject, term_exc)
            return None
        return Delivery(msg, message, self._tracer)
