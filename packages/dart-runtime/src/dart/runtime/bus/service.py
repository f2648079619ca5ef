"""Request handlers bound to a subject: decode, run concurrently, answer, never crash.

A :class:`Service` is what :meth:`Bus.serve <dart.runtime.bus.Bus.serve>` and
:meth:`Bus.subscribe <dart.runtime.bus.Bus.subscribe>` return. Every received message is decoded
through :func:`~dart.protocol.messages.codec.decode`; input that does not decode is answered with
``ErrorReply(code=invalid_request)``, a handler that raises is answered with
``ErrorReply(code=internal)`` (or the code of a :class:`~dart.protocol.errors.ServiceError`), and
each outcome is counted in :class:`~dart.runtime.bus.stats.EndpointStats`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from pydantic import BaseModel, TypeAdapter

from dart.protocol.errors import MessageValidationError, PayloadTooLargeError, ServiceError
from dart.protocol.messages.base import ErrorCode, ErrorReply, Message
from dart.protocol.messages.codec import decode, encode
from dart.runtime.bus.encoding import encode_message
from dart.runtime.bus.stats import BusStats, EndpointStats
from dart.runtime.bus.tracing import BusTracer

log = logging.getLogger("dart.runtime.bus")

Schema = type[BaseModel] | TypeAdapter[Any]
"""What received bytes are validated against: a message class or a ``TypeAdapter`` over a union."""

Handler = Callable[[Any], Awaitable[Any]]


class Service:
    """Handlers of one subject, run concurrently up to a bound.

    Lifecycle:
        ``serving``: from :meth:`Bus.serve` (the subscription is registered with the server
        before it returns, so a request sent right after is answered). Each message gets its own
        asyncio task; when ``max_concurrency`` handlers are running, reading further messages
        waits for one to finish (they queue in the client's subscription buffer).
        ``stopped``: after :meth:`stop` or the bus closing. ``stop`` stops taking messages,
        lets in-flight handlers finish within a timeout and cancels the rest (their requesters
        then see a timeout). Idempotent.

    Attributes:
        subject: The subject served (may be a wildcard).
        queue: Queue group name; members of one group share the subject's messages.
        stats: This subject's counters (shared by every service of the same subject on the bus).
    """

    def __init__(
        self,
        nc: NatsClient,
        subject: str,
        schema: Schema,
        handler: Handler,
        bus_stats: BusStats,
        tracer: BusTracer,
        *,
        queue: str | None,
        max_concurrency: int,
        reply: bool,
        max_message_bytes: int | None = None,
    ) -> None:
        self.subject = subject
        self._max_message_bytes = max_message_bytes or nc.max_payload
        self.queue = queue
        self.stats: EndpointStats = bus_stats.endpoints.setdefault(subject, EndpointStats())
        self._nc = nc
        self._schema = schema
        self._handler = handler
        self._bus_stats = bus_stats
        self._tracer = tracer
        self._reply = reply
        self._slots = asyncio.Semaphore(max_concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._sub: Subscription | None = None
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` has run."""
        return self._stopped

    async def start(self) -> None:
        """Subscribe and wait until the server has registered the subscription."""
        self._sub = await self._nc.subscribe(self.subject, queue=self.queue or "", cb=self._on_msg)
        # A flush round-trip guarantees the SUB reached the server before serve() returns.
        await self._nc.flush()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking messages, wait up to ``timeout_s`` for in-flight handlers, cancel the rest."""
        if self._stopped:
            return
        self._stopped = True
        if self._sub is not None and not self._nc.is_closed:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # the connection may be closing under us; nothing to undo
                log.debug("unsubscribe from %s failed: %s", self.subject, exc)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                log.warning(
                    "cancelled %d handlers of %s still running after %.1fs", len(pending), self.subject, timeout_s
                )
                await asyncio.gather(*pending, return_exceptions=True)

    async def _on_msg(self, msg: Msg) -> None:
        if self._stopped:
            return
        # Waiting here (not in the task) is the backpressure: the subscription stops reading.
        await self._slots.acquire()
        self.stats.in_flight += 1
        task = asyncio.create_task(self._handle(msg), name=f"serve {self.subject}")
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()
        self.stats.in_flight -= 1
        if not task.cancelled() and task.exception() is not None:
            # _handle answers every failure itself; reaching here is a bug in this module.
            log.error("serving %s failed", self.subject, exc_info=task.exception())

    async def _handle(self, msg: Msg) -> None:
        with self._tracer.receive(
            "handle" if self._reply else "process", msg.subject, msg.headers, _span_kind(self._reply)
        ) as span:
            answer = await self._answer(msg, span)
            if answer is None or not msg.reply:
                return
            try:
                await self._nc.publish(msg.reply, answer)
            except Exception as exc:  # the requester will time out; the service keeps going
                log.warning("cannot send reply on %s: %s", self.subject, exc)

    async def _answer(self, msg: Msg, span: Span) -> bytes | None:
        """Run the handler on a decoded message; return the reply bytes (None: nothing to send)."""
        try:
            request = decode(msg.data, self._schema)
        except MessageValidationError as exc:
            self._count("invalid_requests")
            span.set_status(Status(StatusCode.ERROR, "invalid request"))
            log.warning("invalid message on %s: %s", msg.subject, exc)
            return _error_bytes(
                ErrorReply(
                    code=ErrorCode.INVALID_REQUEST,
                    message=f"{exc}. Send a valid {exc.expected} message.",
                    details={"expected": exc.expected, "errors": exc.errors},
                )
            )
        try:
            result = await self._handler(request)
            if not self._reply:
                self._count("requests_served")
                return None
            if not isinstance(result, Message):
                raise TypeError(f"handler returned {type(result).__name__}, expected a Message")
            data = await encode_message(result)
            if len(data) > self._max_message_bytes:
                # Checked here so the requester gets an error reply now instead of a timeout.
                raise PayloadTooLargeError(msg.subject, len(data), self._max_message_bytes)
        except ServiceError as exc:
            self._count("error_replies")
            span.set_status(Status(StatusCode.ERROR, exc.code))
            reply = ErrorReply(
                code=_error_code(exc.code), message=exc.message, details=exc.details, retryable=exc.retryable
            )
            return _error_bytes(reply)
        except Exception as exc:
            self._count("handler_errors")
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            log.exception("handler of %s failed", msg.subject)
            message = f"{type(exc).__name__}: {exc}"
            return _error_bytes(ErrorReply(code=ErrorCode.INTERNAL, message=message))
        self._count("requests_served")
        return data

    def _count(self, counter: str) -> None:
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        setattr(self._bus_stats, counter, getattr(self._bus_stats, counter) + 1)


def _span_kind(reply: bool) -> SpanKind:
    return SpanKind.SERVER if reply else SpanKind.CONSUMER


def _error_code(code: str) -> ErrorCode:
    try:
        return ErrorCode(code)
    except ValueError:
        log.error("handler raised ServiceError with unknown code %r; answering internal", code)
        return ErrorCode.INTERNAL


def _error_bytes(reply: ErrorReply) -> bytes:
    try:
        return encode(reply)
    except Exception:  # details that are not JSON values must not turn an answer into silence
        return encode(reply.model_copy(update={"details": {"unserializable_details": True}}))
