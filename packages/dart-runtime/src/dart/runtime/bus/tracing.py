"""W3C trace context over NATS headers.

Senders open a CLIENT (request) or PRODUCER (publish) span and inject its context into the message
headers with OpenTelemetry's global propagator; receivers extract it and run their handler in a
SERVER or CONSUMER span that is a child of the sender's, so one trajectory is one trace across
services. Only the OpenTelemetry API is used here: the process's telemetry setup chooses providers
and exporters, and without one every span is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, TracerProvider

TRACER_NAME = "dart.runtime.bus"


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Return ``headers`` (or a new dict) with the current trace context added."""
    carrier: dict[str, str] = dict(headers) if headers else {}
    propagate.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> Context:
    """The trace context carried by received headers (an empty context when there is none)."""
    if not headers:
        return Context()
    # Header names are case-insensitive on the wire; the W3C propagator looks up lowercase keys.
    return propagate.extract({key.lower(): value for key, value in headers.items()})


def _attributes(operation: str, subject: str) -> dict[str, str]:
    # OpenTelemetry messaging semantic conventions.
    return {
        "messaging.system": "nats",
        "messaging.operation.name": operation,
        "messaging.destination.name": subject,
    }


class BusTracer:
    """Opens the bus's sender and receiver spans.

    Args:
        provider: Tracer provider to use; None (the default) uses OpenTelemetry's global provider,
            resolved when each span starts, so a provider installed after the bus connected (by
            the process's telemetry setup) is still used.
    """

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=provider)

    @contextmanager
    def send(self, operation: str, subject: str, kind: SpanKind) -> Iterator[tuple[Span, dict[str, str]]]:
        """Open a sender-side span and yield it with headers that carry its context.

        Args:
            operation: ``request`` or ``publish``.
            subject: Destination subject.
            kind: ``SpanKind.CLIENT`` for request/reply, ``SpanKind.PRODUCER`` for publishes.
        """
        with self._tracer.start_as_current_span(
            f"{operation} {subject}", kind=kind, attributes=_attributes(operation, subject)
        ) as span:
            yield span, inject_headers()

    @contextmanager
    def receive(
        self, operation: str, subject: str, headers: Mapping[str, str] | None, kind: SpanKind
    ) -> Iterator[Span]:
        """Open a receiver-side span, child of the sender's span found in ``headers``.

        Args:
            operation: ``handle`` (served request) or ``process`` (consumed message).
            subject: The subject the message arrived on.
            headers: The received message's headers.
            kind: ``SpanKind.SERVER`` for served requests, ``SpanKind.CONSUMER`` for consumed messages.
        """
        with self._tracer.start_as_current_span(
            f"{operation} {subject}",
            context=extract_context(headers),
            kind=kind,
            attributes=_attributes(operation, subject),
        ) as span:
            yield span
