"""JetStream: idempotent stream and consumer setup, deduplicated publishes, stream and consumer state.

What must not be lost (work items, trajectories, batches, model versions) travels on streams.
Publishers pass a message id, so a retried publish within the stream's duplicate window is stored
once. Consumers are durable pull consumers with explicit acks: a message that is not acked within
``ack_wait`` (its consumer died, or is too slow and did not call ``in_progress``) is redelivered,
up to ``max_deliver`` times (consumption lives in :mod:`dart.runtime.bus.consumer`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import nats.errors
import nats.js.errors
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
from opentelemetry.trace import SpanKind

from dart.protocol.errors import JetStreamError, PayloadTooLargeError
from dart.protocol.messages.base import Message
from dart.runtime.bus.encoding import encode_message
from dart.runtime.bus.tracing import BusTracer

log = logging.getLogger("dart.runtime.bus")

Retention = Literal["limits", "interest", "workqueue"]
Storage = Literal["file", "memory"]
Discard = Literal["old", "new"]
DeliverFrom = Literal["all", "new", "last"]
EnsureResult = Literal["created", "updated", "unchanged"]
"""What an ``ensure_*`` call did: created the object, updated its config, or found it as asked."""

DEFAULT_DUPLICATE_WINDOW_S = 120.0
"""How long a publish id is remembered when a stream does not say (capped at its max age)."""

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


@dataclass(frozen=True)
class StreamState:
    """A stream's contents right now.

    Attributes:
        messages: Messages stored.
        bytes: Bytes stored.
        first_seq: Sequence of the oldest stored message.
        last_seq: Sequence of the newest stored message.
        consumers: Consumers defined on the stream.
    """

    messages: int
    bytes: int
    first_seq: int
    last_seq: int
    consumers: int


@dataclass(frozen=True)
class StreamCensus:
    """What a stream holds, read message by message (``Bus.census``).

    Attributes:
        messages: Messages read.
        largest_bytes: Size of the largest one (0 when empty).
        distinct: Distinct values of the identifying field among them: a message stored twice (a replay
            past the stream's duplicate window) counts once; one without the field counts on its own.
    """

    messages: int
    largest_bytes: int
    distinct: int

    @property
    def duplicates(self) -> int:
        """Messages that repeat an identity stored before them."""
        return self.messages - self.distinct


@dataclass(frozen=True)
class ConsumerState:
    """A durable consumer's backlog right now (queue depth for telemetry and tests).

    Attributes:
        num_pending: Stored messages not yet delivered to this consumer.
        num_ack_pending: Delivered messages not yet acked (in flight or awaiting redelivery).
        num_redelivered: Messages delivered more than once.
        num_waiting: Pull requests waiting for messages (idle fetchers).
        ack_floor: Stream sequence at and below which every message was acked (or terminated). A message
            that reached the consumer's delivery limit unacked holds it back for good.
        delivered: Stream sequence of the last message delivered.
    """

    num_pending: int
    num_ack_pending: int
    num_redelivered: int
    num_waiting: int
    ack_floor: int = 0
    delivered: int = 0


async def stream_state(js: JetStreamContext, name: str) -> StreamState:
    """The current state of a stream; raises :class:`JetStreamError` when it does not exist."""
    try:
        info = await js.stream_info(name)
    except (nats.errors.Error, TimeoutError) as exc:
        raise JetStreamError("stream_state", name, reason(exc)) from exc
    state = info.state
    return StreamState(state.messages, state.bytes, state.first_seq, state.last_seq, state.consumer_count)


async def consumer_state(js: JetStreamContext, stream: str, durable: str) -> ConsumerState:
    """The current backlog of a durable consumer; raises :class:`JetStreamError` when it does not exist."""
    try:
        info = await js.consumer_info(stream, durable)
    except (nats.errors.Error, TimeoutError) as exc:
        raise JetStreamError("consumer_state", f"{stream}/{durable}", reason(exc)) from exc
    return ConsumerState(
        num_pending=info.num_pending or 0,
        num_ack_pending=info.num_ack_pending or 0,
        num_redelivered=info.num_redelivered or 0,
        num_waiting=info.num_waiting or 0,
        ack_floor=(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0,
        delivered=(info.delivered.stream_seq or 0) if info.delivered is not None else 0,
    )


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


def reason(exc: BaseException) -> str:
    if isinstance(exc, nats.js.errors.APIError) and exc.description:
        return f"{exc.description} (err_code {exc.err_code})"
    if isinstance(exc, nats.errors.NoRespondersError | nats.js.errors.ServiceUnavailableError):
        return (
            "JetStream is not answering: a cluster electing the stream's leader (for a moment),"
            " or a server without JetStream (nats-server -js)"
        )
    if isinstance(exc, TimeoutError):
        return "JetStream API timed out"
    return f"{type(exc).__name__}: {exc}"


def _duplicate_window(window_s: float | None, max_age_s: float | None) -> float:
    if window_s is not None:
        return float(window_s)
    # The server's default is 2 min, but it refuses a window longer than the stream's max age.
    return float(min(DEFAULT_DUPLICATE_WINDOW_S, max_age_s or DEFAULT_DUPLICATE_WINDOW_S))


async def ensure_stream(
    js: JetStreamContext,
    name: str,
    subjects: Sequence[str],
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
        "duplicate_window": _duplicate_window(duplicate_window_s, max_age_s),
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
        raise JetStreamError("ensure_stream", name, reason(exc)) from exc


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
        raise JetStreamError("ensure_consumer", f"{stream}/{durable}", reason(exc)) from exc


async def js_publish(
    js: JetStreamContext,
    tracer: BusTracer,
    subject: str,
    msg: Message,
    msg_id: str,
    *,
    timeout: float,
    stream: str | None = None,
    max_payload: int = 0,
) -> PublishAck:
    """Persist one message with a dedupe id; see :meth:`Bus.js_publish <dart.runtime.bus.Bus.js_publish>`.

    ``max_payload`` is the bus's message size limit (``bus.max_message_bytes``); 0 leaves it to the server.
    """
    if not msg_id:
        raise ValueError("msg_id must be a non-empty id that is the same when the same message is retried")
    data = await encode_message(msg)
    if max_payload and len(data) > max_payload:
        raise PayloadTooLargeError(subject, len(data), max_payload)
    with tracer.send("publish", subject, SpanKind.PRODUCER) as (span, headers):
        headers[Header.MSG_ID] = msg_id
        span.set_attribute("messaging.message.id", msg_id)
        try:
            ack = await js.publish(subject, data, timeout=timeout, stream=stream, headers=headers)
        except nats.js.errors.NoStreamResponseError as exc:
            raise JetStreamError(
                "js_publish",
                subject,
                "no stream answered for this subject: none stores it (ensure_stream first), or the cluster "
                "is electing its leader (for a moment)",
            ) from exc
        except nats.errors.MaxPayloadError as exc:
            raise PayloadTooLargeError(subject, len(data), max_payload) from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise JetStreamError("js_publish", subject, reason(exc)) from exc
        return PublishAck(stream=ack.stream, seq=ack.seq, duplicate=bool(ack.duplicate))
