"""A JetStream cluster of three real nats-servers: with ``bus.replicas: 3`` the run's streams and state bucket
are copied on every node, and they keep each message through the loss of the node that leads them."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Literal, TypeVar

import nats
import pytest

from dart.embedded.nats import EmbeddedNats, EmbeddedNatsCluster, NatsRoutes
from dart.protocol.errors import DartError
from dart.protocol.messages import ModelVersion
from dart.protocol.messages.base import Message
from dart.protocol.topology import LATEST_MODEL_KEY, STREAMS
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.ports import free_port
from dart.runtime.topology import durable_name, ensure_topology

pytestmark = pytest.mark.integration

T = TypeVar("T")


class Work(Message):
    kind: Literal["work"] = "work"
    item_id: str


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmbeddedNatsCluster]:
    with EmbeddedNatsCluster(3, store_dir=tmp_path / "cluster") as running:
        yield running


async def until_it_works(what: Callable[[], Awaitable[T]], timeout_s: float = 60.0) -> T:
    """What a service does while a cluster elects a new leader: the call fails for a moment; ask again."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await what()
        except DartError:
            if time.monotonic() > deadline:
                raise


async def test_streams_and_the_state_bucket_keep_everything_through_a_leader_loss(
    cluster: EmbeddedNatsCluster,
) -> None:
    config = BusConfig(url=cluster.urls, run="cluster", replicas=3, connect_timeout_s=5.0, request_timeout_s=5.0)
    async with await Bus.connect(config) as bus:
        state = await ensure_topology(bus)
        await state.put(LATEST_MODEL_KEY, ModelVersion(version=1, uri="s3://b/w/1", sha256="a" * 64, created_at=1.0))
        subject = bus.subjects.stream_subject("work")
        for i in range(10):
            await bus.js_publish(subject, Work(item_id=f"w{i}"), msg_id=f"w{i}")

        # Every stream of the run and its state bucket on all three nodes.
        nc = await nats.connect(cluster.urls, connect_timeout=5)
        try:
            js = nc.jetstream()
            names = [bus.subjects.stream_name(kind) for kind in STREAMS] + [f"KV_{bus.subjects.kv_bucket('state')}"]
            for name in names:
                info = await js.stream_info(name)
                assert info.config.num_replicas == 3, name
            work = await js.stream_info(bus.subjects.stream_name("work"))
            assert work.cluster is not None and work.cluster.leader is not None
            leader = work.cluster.leader
        finally:
            await nc.close()

        await asyncio.to_thread(cluster.kill, int(leader.rsplit("-", 1)[1]))
        # The client moves to another node; the stream elects a new leader and keeps what it had.
        for i in range(10, 20):
            await until_it_works(lambda i=i: bus.js_publish(subject, Work(item_id=f"w{i}"), msg_id=f"w{i}"))
        consumer = await until_it_works(lambda: bus.pull_consumer("work", durable_name(bus, "work"), Work))
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while len(seen) < 20 and time.monotonic() < deadline:
            try:
                deliveries = await consumer.fetch(20, timeout=1.0)
            except DartError:
                continue
            for delivery in deliveries:
                seen.append(delivery.message.item_id)
                await delivery.ack()
        assert sorted(seen) == sorted(f"w{i}" for i in range(20))  # each once: none lost, none twice
        latest = await until_it_works(lambda: state.get(LATEST_MODEL_KEY, ModelVersion))
        assert latest is not None and latest.version == 1

        # Back on its ports and store, the node catches up (healthy means its streams are current).
        await asyncio.to_thread(cluster.restart, int(leader.rsplit("-", 1)[1]))
        await until_it_works(
            lambda: state.put(
                LATEST_MODEL_KEY, ModelVersion(version=2, uri="s3://b/w/2", sha256="b" * 64, created_at=2.0)
            )
        )
        latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
        assert latest is not None and latest.version == 2


def _routes_of(node: EmbeddedNats) -> set[str]:
    """The server names ``node`` holds routes to now (its monitoring endpoint)."""
    with urllib.request.urlopen(f"http://{node.host}:{node.monitor_port}/routez", timeout=5) as resp:
        return {r.get("remote_name", "") for r in json.load(resp).get("routes") or []}


@pytest.mark.parametrize("password", ["", "not-the-route-password"])
def test_a_server_without_the_route_password_cannot_join_the_cluster(
    cluster: EmbeddedNatsCluster, tmp_path: Path, password: str
) -> None:
    """A route bypasses every client permission: one solicited without the cluster's password is refused."""
    first = cluster.nodes[0]
    assert first.routes is not None
    members = {n.server_name for n in cluster.nodes[1:]}
    assert _routes_of(first) >= members  # the nodes themselves are routed (with the password)
    intruder = EmbeddedNats(
        store_dir=tmp_path / "intruder",
        routes=NatsRoutes(first.routes.cluster, free_port(), (first.routes.routes[0],), password),
        server_name="intruder",
    )
    with intruder:
        deadline = time.monotonic() + 60.0
        while "Authorization Violation" not in intruder.log_tail(200):  # the cluster's answer to its route
            assert time.monotonic() < deadline, intruder.log_tail(40)
            time.sleep(0.2)
        assert "intruder" not in _routes_of(first)
