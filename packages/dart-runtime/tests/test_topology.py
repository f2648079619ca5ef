from __future__ import annotations

import uuid

import pytest

from dart.protocol.messages import ModelVersion
from dart.protocol.topology import LATEST_MODEL_KEY, STREAMS
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.testing import all_messages
from dart.runtime.topology import announced_version, durable_name, ensure_topology

pytestmark = pytest.mark.integration


async def test_topology_is_idempotent_and_usable(nats_url: str) -> None:
    config = BusConfig(url=nats_url, run=f"topo{uuid.uuid4().hex[:8]}")
    async with await Bus.connect(config) as a, await Bus.connect(config) as b:
        state = await ensure_topology(a)
        await ensure_topology(b)  # a second service starting: no conflict
        for kind in STREAMS:
            assert (await a.ensure_stream(kind, retention=STREAMS[kind].retention, duplicate_window_s=600.0)) == (
                "unchanged"
            )
        work = next(msg for msg in all_messages() if msg.kind == "work_item")  # type: ignore[attr-defined]
        await a.js_publish(a.subjects.stream_subject("work"), work, msg_id="w1")
        consumer = await b.pull_consumer("work", durable_name(b, "work"), type(work))
        [delivery] = await consumer.fetch(1, timeout=2)
        assert delivery.message == work
        await delivery.ack()
        await consumer.close()
        model = next(msg for msg in all_messages() if msg.kind == "model_version")  # type: ignore[attr-defined]
        await state.put(LATEST_MODEL_KEY, model)
        assert await state.get(LATEST_MODEL_KEY, type(model)) == model


async def test_announced_versions_are_found_by_number_on_the_model_stream(nats_url: str) -> None:
    config = BusConfig(url=nats_url, run=f"topo{uuid.uuid4().hex[:8]}")
    async with await Bus.connect(config) as bus:
        await ensure_topology(bus)
        assert await announced_version(bus, 1) is None  # nothing announced yet
        model = next(msg for msg in all_messages() if isinstance(msg, ModelVersion))
        announced = {v: model.model_copy(update={"version": v, "created_at": float(v)}) for v in (1, 3, 4)}
        for version in announced.values():
            await bus.js_publish(bus.subjects.stream_subject("model"), version, msg_id=f"model-v{version.version}")
        for number, version in announced.items():
            assert await announced_version(bus, number) == version
        # Never announced: before the first, between two, past the newest.
        for number in (0, 2, 5):
            assert await announced_version(bus, number) is None
