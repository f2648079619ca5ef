"""The NATS bus client: typed request/reply, serving, JetStream and KV, with trace propagation.

Example::

    from dart.protocol.bus import Bus, BusConfig

    async with await Bus.connect(BusConfig(url="nats://127.0.0.1:4222", run="exp-1")) as bus:
        await bus.serve(bus.subjects.bench("echo"), Echo, echo_handler)
        reply = await bus.request(bus.subjects.bench("echo"), Echo(text="hi"), Echo)
"""

from dart.protocol.bus.client import Bus
from dart.protocol.bus.config import BusConfig
from dart.protocol.bus.consumer import Delivery, PullConsumer
from dart.protocol.bus.jetstream import ConsumerState, EnsureResult, PublishAck, StreamCensus, StreamState
from dart.protocol.bus.kv import KeyValueStore, KvEntry
from dart.protocol.bus.service import Service
from dart.protocol.bus.stats import BusStats, EndpointStats

__all__ = [
    "Bus",
    "BusConfig",
    "BusStats",
    "ConsumerState",
    "Delivery",
    "EndpointStats",
    "EnsureResult",
    "KeyValueStore",
    "KvEntry",
    "PublishAck",
    "PullConsumer",
    "Service",
    "StreamCensus",
    "StreamState",
]
