"""The async NATS bus client every DART service talks through.

One :class:`Bus` per process wraps one NATS connection and offers typed request/reply, publish,
serving, JetStream streams and consumers, and KV buckets. Every message is a
:class:`~dart.protocol.messages.base.Message` validated on receive; every failure is a
:class:`~dart.protocol.errors.BusError` subtype; every send carries W3C trace context.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar, overload

import nats.errors
from nats.aio.client import Client as NatsClient
from opentelemetry.trace import SpanKind, TracerProvider
from pydantic import BaseModel, TypeAdapter

from dart.protocol.errors import (
    BusConnectionError,
    DartError,
    MessageValidationError,
    NoRespondersError,
    PayloadTooLargeError,
    RemoteError,
    RequestTimeoutError,
    SubjectError,
)
from dart.protocol.messages.base import ErrorReply, Message
from dart.protocol.messages.codec import decode
from dart.protocol.subjects import Subjects
from dart.runtime.bus.auth import DenialWatch
from dart.runtime.bus.config import BusConfig
from dart.runtime.bus.connection import open_connection
from dart.runtime.bus.consumer import PullConsumer
from dart.runtime.bus.encoding import encode_message
from dart.runtime.bus.service import Service
from dart.runtime.bus.stats import BusStats
from dart.runtime.bus.streams import JetStreamMethods
from dart.runtime.bus.tracing import BusTracer

log = logging.getLogger("dart.runtime.bus")

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class Bus(JetStreamMethods):
    """A connection to NATS with typed messaging on top.

    Lifecycle:
        ``connected``: returned by :meth:`connect`. If the server goes away the client reconnects
        on its own (``max_reconnect_attempts``, ``-1`` = forever), buffering publishes meanwhile;
        disconnects and reconnects are logged. ``closed``: after :meth:`close` (immediate: running
        handlers are cancelled) or :meth:`drain` (graceful: services stop taking messages, in-flight
        handlers finish, pending publishes are flushed), or once reconnect attempts are exhausted.
        A closed bus cannot be reopened; connect a new one. Use ``async with`` to close on exit.

    Example::

        async with await Bus.connect(BusConfig(url=url, run="exp-1")) as bus:
            reply = await bus.request(bus.subjects.bench("echo"), Echo(text="hi"), Echo)
    """

    def __init__(
        self,
        nc: NatsClient,
        config: BusConfig,
        stats: BusStats | None = None,
        tracer_provider: TracerProvider | None = None,
        denials: DenialWatch | None = None,
    ) -> None:
        """Use :meth:`connect`; this wraps an already connected client."""
        self._nc = nc
        self._js = nc.jetstream(timeout=config.request_timeout_s)
        self._config = config
        self._subjects = config.subjects()
        self._stats = stats or BusStats()
        self._tracer = BusTracer(tracer_provider)
        self._services: list[Service] = []
        self._consumers: list[PullConsumer[Any]] = []
        self._denials = denials or DenialWatch(config.user)

    @classmethod
    async def connect(cls, config: BusConfig | None = None, *, tracer_provider: TracerProvider | None = None) -> Bus:
        """Connect to the configured servers, failing after ``config.connect_timeout_s``.

        The first connection is retried (every ``reconnect_wait_s``) until the deadline, so a
        service started alongside its NATS server waits for it instead of failing at once.

        Args:
            config: Servers, subject namespace, timeouts (default: a local server).
            tracer_provider: Where the bus's spans go; None uses OpenTelemetry's global provider
                (what services want: their telemetry setup installs it).

        Raises:
            BusAuthError: The server refused the credentials (none, a wrong password, an unknown
                user); raised as soon as the server says so, naming the user.
            BusConnectionError: No server answered before the deadline (the message names the URLs
                and the last error, e.g. connection refused).
            ConfigError: ``token_env`` / ``password_env`` name an unset variable, or ``creds_file``,
                ``password_file`` or a TLS file cannot be read.
        """
        config = config or BusConfig()
        nc, watch = await open_connection(config)
        return cls(nc, config, watch.stats, tracer_provider, watch.denials)

    # --- properties ---------------------------------------------------------------------------
    @property
    def config(self) -> BusConfig:
        """The config this bus was connected with."""
        return self._config

    @property
    def subjects(self) -> Subjects:
        """Subject and stream names for this bus's prefix and run."""
        return self._subjects

    @property
    def stats(self) -> BusStats:
        """Live counters of served requests, rejected input and poison messages."""
        return self._stats

    @property
    def denials(self) -> DenialWatch:
        """Permission violations the server reported on this connection."""
        return self._denials

    @property
    def is_connected(self) -> bool:
        """Whether the connection is up right now (False while reconnecting or once closed)."""
        return bool(self._nc.is_connected)

    # --- core request/reply -------------------------------------------------------------------
    @overload
    async def request(self, subject: str, msg: Message, reply_type: type[M], *, timeout: float | None = None) -> M: ...
    @overload
    async def request(
        self, subject: str, msg: Message, reply_type: TypeAdapter[T], *, timeout: float | None = None
    ) -> T: ...
    async def request(
        self,
        subject: str,
        msg: Message,
        reply_type: type[BaseModel] | TypeAdapter[Any],
        *,
        timeout: float | None = None,
    ) -> Any:
        """Send a request and return its validated reply.

        Args:
            subject: Destination, from :attr:`subjects`.
            msg: The request.
            reply_type: The expected reply: a message class or a ``TypeAdapter`` over a union.
            timeout: Seconds to wait for the reply (default ``config.request_timeout_s``).

        Raises:
            RemoteError: The service answered with an ``ErrorReply`` (``.code`` says why).
            RequestTimeoutError: No reply within ``timeout``.
            NoRespondersError: Nobody serves ``subject``.
            MessageValidationError: The reply does not match ``reply_type``.
            PayloadTooLargeError: The request exceeds ``config.max_message_bytes``.
            SubjectError: ``subject`` is not a valid subject.
            BusConnectionError: The bus is closed.
        """
        timeout = self._config.request_timeout_s if timeout is None else timeout
        data = await self._encode(subject, msg)
        with self._tracer.send("request", subject, SpanKind.CLIENT) as (_, headers):
            try:
                reply = await self._denials.guard(
                    "publish", subject, self._nc.request(subject, data, timeout=timeout, headers=headers)
                )
            except nats.errors.NoRespondersError:
                raise NoRespondersError(subject) from None
            except TimeoutError:
                raise RequestTimeoutError(subject, timeout) from None
            except nats.errors.Error as exc:
                raise self._send_error(exc, subject, len(data)) from exc
            return _decode_reply(subject, reply.data, reply_type)

    async def publish(self, subject: str, msg: Message) -> None:
        """Publish a message on core NATS (fire and forget: not stored, lost if nobody listens).

        Raises:
            PayloadTooLargeError: The message exceeds ``config.max_message_bytes``.
            BusConnectionError: The bus is closed.
        """
        data = await self._encode(subject, msg)
        with self._tracer.send("publish", subject, SpanKind.PRODUCER) as (_, headers):
            try:
                await self._nc.publish(subject, data, headers=headers)
            except nats.errors.Error as exc:
                raise self._send_error(exc, subject, len(data)) from exc

    @overload
    async def serve(
        self,
        subject: str,
        request_type: type[M],
        handler: Callable[[M], Awaitable[Message]],
        *,
        queue: str | None = None,
        max_concurrency: int | None = None,
    ) -> Service: ...
    @overload
    async def serve(
        self,
        subject: str,
        request_type: TypeAdapter[T],
        handler: Callable[[T], Awaitable[Message]],
        *,
        queue: str | None = None,
        max_concurrency: int | None = None,
    ) -> Service: ...
    async def serve(
        self,
        subject: str,
        request_type: type[BaseModel] | TypeAdapter[Any],
        handler: Callable[[Any], Awaitable[Message]],
        *,
        queue: str | None = None,
        max_concurrency: int | None = None,
    ) -> Service:
        """Answer requests on ``subject`` with ``handler``; returns once the server knows.

        Each request is decoded as ``request_type`` and handled in its own task, at most
        ``max_concurrency`` at once (default ``config.serve_concurrency``). The handler returns the
        reply message, or raises :class:`~dart.protocol.errors.ServiceError` for a typed error
        reply. Undecodable input gets ``ErrorReply(invalid_request)`` and any other exception
        ``ErrorReply(internal)``; both are counted in :attr:`stats` and the service keeps going.

        Args:
            subject: Subject to serve (wildcards allowed).
            request_type: A message class or a ``TypeAdapter`` over a union of requests.
            handler: ``async def handler(request) -> Message``.
            queue: Queue group; services in one group share the requests (load balancing).
            max_concurrency: Bound on concurrently running handlers.

        Returns:
            The running :class:`Service`; ``await service.stop()`` to stop serving.
        """
        return await self._start_service(subject, request_type, handler, queue, max_concurrency, reply=True)

    async def subscribe(
        self,
        subject: str,
        message_type: type[BaseModel] | TypeAdapter[Any],
        handler: Callable[[Any], Awaitable[None]],
        *,
        queue: str | None = None,
        max_concurrency: int | None = None,
    ) -> Service:
        """Handle core-NATS publishes on ``subject`` (like :meth:`serve`, without replies).

        Undecodable messages and handler failures are logged and counted, never raised.
        """
        return await self._start_service(subject, message_type, handler, queue, max_concurrency, reply=False)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until everything published so far has reached the server."""
        seconds = self._config.request_timeout_s if timeout is None else timeout
        try:
            await self._nc.flush(timeout=seconds)  # type: ignore[arg-type]  # nats-py annotates int, takes float
        except nats.errors.Error as exc:
            raise self._connection_error(exc) from exc

    # --- lifecycle ----------------------------------------------------------------------------
    async def close(self) -> None:
        """Close now: services stop (running handlers are cancelled), the connection closes."""
        await self._shutdown(handler_timeout_s=0.0)
        await self._nc.close()

    async def drain(self) -> None:
        """Close gracefully: stop taking messages, let handlers finish, flush publishes, close."""
        await self._shutdown(handler_timeout_s=self._config.drain_timeout_s)
        if not self._nc.is_closed:
            try:
                await self._nc.drain()
            except nats.errors.Error as exc:
                log.warning("draining the NATS connection failed (%s); closing", exc)
                await self._nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- internals ----------------------------------------------------------------------------
    async def _start_service(
        self,
        subject: str,
        schema: type[BaseModel] | TypeAdapter[Any],
        handler: Callable[[Any], Awaitable[Any]],
        queue: str | None,
        max_concurrency: int | None,
        *,
        reply: bool,
    ) -> Service:
        service = Service(
            self._nc,
            subject,
            schema,
            handler,
            self._stats,
            self._tracer,
            queue=queue,
            max_concurrency=max_concurrency or self._config.serve_concurrency,
            reply=reply,
            max_message_bytes=self._config.max_message_bytes,
        )
        try:
            await service.start()
        except nats.errors.Error as exc:
            raise self._send_error(exc, subject, 0) from exc
        if not self._denials.denied("subscribe", subject):
            # start() flushed, and the server sends its refusal before that PONG; one more round trip
            # covers a refusal that reached the error callback behind it (seen once in a full test session).
            try:
                await self._nc.flush()
            except nats.errors.Error as exc:
                raise self._send_error(exc, subject, 0) from exc
        if self._denials.denied("subscribe", subject):
            await service.stop(timeout_s=0.0)
            raise self._denials.error("subscribe", subject)
        self._services = [s for s in self._services if not s.stopped] + [service]
        return service

    async def _shutdown(self, handler_timeout_s: float) -> None:
        services, self._services = self._services, []
        await asyncio.gather(*(s.stop(timeout_s=handler_timeout_s) for s in services))
        consumers, self._consumers = self._consumers, []
        await asyncio.gather(*(c.close() for c in consumers))

    def _connection_error(self, exc: BaseException) -> BusConnectionError:
        return BusConnectionError(self._config.servers, f"{type(exc).__name__}: {exc}")

    @property
    def max_message_bytes(self) -> int:
        """Largest encoded message this client sends or replies with, bytes."""
        return self._config.max_message_bytes

    async def _encode(self, subject: str, msg: Message) -> bytes:
        data = await encode_message(msg)
        if len(data) > self._config.max_message_bytes:
            raise PayloadTooLargeError(subject, len(data), self._config.max_message_bytes)
        return data

    def _send_error(self, exc: nats.errors.Error, subject: str, size: int) -> DartError:
        """The DART error for a failed send: an oversized message, a bad subject, or the connection."""
        if isinstance(exc, nats.errors.MaxPayloadError):
            return PayloadTooLargeError(subject, size, self._config.max_message_bytes)
        if isinstance(exc, nats.errors.BadSubjectError):
            return SubjectError(f"{subject!r} is not a valid NATS subject: build subjects with Subjects")
        return self._connection_error(exc)


def _decode_reply(subject: str, data: bytes, reply_type: type[BaseModel] | TypeAdapter[Any]) -> Any:
    """Validate a reply; an ``ErrorReply`` (expected or not) becomes :class:`RemoteError`."""
    try:
        reply = decode(data, reply_type)
    except MessageValidationError as exc:
        mismatch = exc
    else:
        if isinstance(reply, ErrorReply):
            raise RemoteError(subject, reply.code.value, reply.message, reply.details, reply.retryable)
        return reply
    # Error replies are rare, so they are only tried once the expected type has failed.
    try:
        error = decode(data, ErrorReply)
    except MessageValidationError:
        raise mismatch from None
    raise RemoteError(subject, error.code.value, error.message, error.details, error.retryable)
