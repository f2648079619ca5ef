"""In-process counters of one bus connection: what was served, rejected, failed or poisoned.

Counters are plain integers updated on the event loop (no locks needed); read them for status
replies, logs and tests, or export them through the telemetry setup.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EndpointStats:
    """Counters of one served subject.

    Attributes:
        requests_served: Requests whose handler returned a result.
        invalid_requests: Requests that failed to decode (bad UTF-8 or JSON, wrong schema or kind);
            answered with ``ErrorReply(code=invalid_request)``.
        handler_errors: Requests whose handler raised an unexpected exception or returned something
            unsendable (not a message, or larger than ``max_payload``); answered with
            ``ErrorReply(code=internal)``.
        error_replies: Requests whose handler raised :class:`~dart.protocol.errors.ServiceError`;
            answered with an ``ErrorReply`` of the handler's code.
        in_flight: Handlers running right now.
    """

    requests_served: int = 0
    invalid_requests: int = 0
    handler_errors: int = 0
    error_replies: int = 0
    in_flight: int = 0


@dataclass
class BusStats:
    """Counters of one :class:`~dart.runtime.bus.Bus`.

    Every counter is monotonic over the bus's life.

    Attributes:
        requests_served: Total of :attr:`EndpointStats.requests_served`.
        invalid_requests: Total of :attr:`EndpointStats.invalid_requests`.
        handler_errors: Total of :attr:`EndpointStats.handler_errors`.
        error_replies: Total of :attr:`EndpointStats.error_replies`.
        poison_messages: Stream messages that failed to decode and were terminated, by
            ``"<stream>/<consumer>"``.
        endpoints: Per-subject counters, one entry per subject served on this bus.
        disconnects: Times the connection was lost.
        reconnects: Times it was re-established (subscriptions are replayed then).
    """

    requests_served: int = 0
    invalid_requests: int = 0
    handler_errors: int = 0
    error_replies: int = 0
    poison_messages: dict[str, int] = field(default_factory=dict)
    endpoints: dict[str, EndpointStats] = field(default_factory=dict)
    disconnects: int = 0
    reconnects: int = 0

    @property
    def poison_total(self) -> int:
        """Poison messages terminated across every consumer."""
        return sum(self.poison_messages.values())

    def endpoint(self, subject: str) -> EndpointStats:
        """Counters of a served subject (a zeroed entry if it is not served)."""
        return self.endpoints.get(subject) or EndpointStats()

    def count_poison(self, stream: str, consumer: str) -> None:
        """Record one terminated undecodable stream message."""
        key = f"{stream}/{consumer}"
        self.poison_messages[key] = self.poison_messages.get(key, 0) + 1
