"""The NATS bus client: typed request/reply, serving, JetStream and KV, with trace propagation.

Example::

    from dart.runtime.bus import Bus, BusConfig

    async with await Bus.connect(BusConfig(url="nats://127.0.0.1:4222", run="exp-1")) as bus:
        await bus.serve(bus.subjects.bench("echo"), Echo, echo_handler)
        reply = await bus.request(bus.subjects.bench("echo"), Echo(text="hi"), Echo)
"""

from dart.runtime.bus.client import Bus
from dart.runtime.bus.config import BusConfig
from dart.runtime.bus.consumer import Delivery, PullConsumer
from dart.runtime.bus.jetstream import ConsumerState, EnsureResult, PublishAck, StreamCensus, StreamState
from dart.runtime.bus.kv import KeyValueStore, KvEntry
from dart.runtime.bus.service import Service
from dart.runtime.bus.stats import BusStats, EndpointStats

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
