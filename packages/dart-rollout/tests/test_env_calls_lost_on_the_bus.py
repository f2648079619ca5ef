"""Env calls that the bus loses: a request that never reaches the env service, a reply that never comes
back. Core NATS delivers at most once, and a broker node that dies takes what is on it; the runner's
heartbeat finds the loss (the service counts the calls it received and answered) and the call is sent
again, instead of the runner waiting out ``env_request_timeout_s``.

Everything is real: nats-server, the env service on the sim, the env client; the loss is made by a real
TCP forwarder in front of nats-server that swallows what one connection sends, then cuts it (as a node
dying with the bytes on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Literal
from urllib.parse import urlparse

import pytest

from dart.env.service import EnvService, EnvServiceConfig
from dart.env.sim import LatencyConfig, SimConfig, sim_task
from dart.protocol.messages import StepReply, Wait
from dart.rollout.service.config import RunnerConfig
from dart.rollout.service.env_client import EnvClient
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.testing import wait_until

FAST_SIM = SimConfig(latency=LatencyConfig(scale=0.0))


class CuttingProxy:
    """A TCP forwarder to nats-server whose connections can swallow what their client sends and be cut.

    While ``swallow`` is on, bytes from clients to the server are kept in ``swallowed`` instead of
    forwarded; :meth:`cut` aborts every connection (the clients reconnect through the proxy) and turns
    swallowing off.
    """

    def __init__(self, nats_url: str) -> None:
        target = urlparse(nats_url)
        assert target.hostname is not None and target.port is not None
        self._target = (target.hostname, target.port)
        self.swallow = False
        self.swallowed = bytearray()
        self._transports: set[asyncio.BaseTransport] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"nats://127.0.0.1:{port}"

    def cut(self) -> None:
        self.swallow = False
        for transport in list(self._transports):
            transport.abort()  # type: ignore[attr-defined]
        self._transports.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self._target)
        self._transports |= {client_w.transport, server_w.transport}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, from_client: bool) -> None:
            try:
                while data := await src.read(65536):
                    if from_client and self.swallow:
                        self.swallowed += data
                        continue
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(client_r, server_w, True), pipe(server_r, client_w, False))


@pytest.fixture
async def proxy(nats_url: str) -> AsyncIterator[CuttingProxy]:
    cutting = CuttingProxy(nats_url)
    yield cutting
    await cutting.close()


def bus_config(url: str, run: str) -> BusConfig:
    return BusConfig(url=url, run=run, connect_timeout_s=2.0, request_timeout_s=5.0, reconnect_wait_s=0.2)


RUNNER = {
    "env_call_check_s": 0.3,
    # Without a resend the call would end env_failed (timeout) after this: the tests would fail, not hang.
    "env_request_timeout_s": 120.0,
    "env_gone_after_s": 60.0,  # a reconnecting env service is not a dead one here
}


@contextlib.asynccontextmanager
async def leased(
    nats_url: str, proxy: CuttingProxy, behind_proxy: Literal["client", "service"]
) -> AsyncIterator[tuple[EnvService, EnvClient, str]]:
    """An env service on the sim and a client holding a lease on its instance, reset to a task; one of the
    two talks to nats-server through the proxy. Yields the service, the client and the instance id."""
    run, pool = f"r{uuid.uuid4().hex[:8]}", f"p{uuid.uuid4().hex[:8]}"
    proxied = await proxy.start()
    service_url, client_url = (nats_url, proxied) if behind_proxy == "client" else (proxied, nats_url)
    async with await Bus.connect(bus_config(service_url, run)) as service_bus:
        service = EnvService(EnvServiceConfig(pool=pool, instances=1, sim=FAST_SIM), service_bus)
        await service.start()
        try:
            async with (
                await Bus.connect(bus_config(client_url, run)) as client_bus,
                EnvClient(client_bus, "runner-0", RunnerConfig(pool=pool, **RUNNER)) as env,
            ):
                lease = await env.lease()
                await env.reset(sim_task("click-button", "easy", 1))
                yield service, env, lease.instance_id
        finally:
            await service.stop()


async def test_a_step_that_never_reached_the_env_service_is_sent_again(nats_url: str, proxy: CuttingProxy) -> None:
    async with leased(nats_url, proxy, behind_proxy="client") as (service, env, instance):
        proxy.swallow = True  # what the client sends goes nowhere
        step = asyncio.create_task(env.step(Wait(seconds=0.0)))
        await wait_until(lambda: f".{instance}.step".encode() in proxy.swallowed)
        proxy.cut()  # the request dies with the connection

        reply = await step
        assert isinstance(reply, StepReply)
        assert service.stats()[instance].steps == 1
        # The episode goes on where it was: the next step index is accepted.
        assert isinstance(await env.step(Wait(seconds=0.0)), StepReply)
        assert service.stats()[instance].steps == 2


async def test_a_step_whose_reply_never_came_back_is_answered_again_without_acting_twice(
    nats_url: str, proxy: CuttingProxy
) -> None:
    async with leased(nats_url, proxy, behind_proxy="service") as (service, env, instance):
        proxy.swallow = True  # what the env service sends (its replies) goes nowhere
        step = asyncio.create_task(env.step(Wait(seconds=0.0)))
        await wait_until(lambda: service.stats()[instance].steps == 1)
        await wait_until(lambda: b"env.step.reply" in proxy.swallowed)
        proxy.cut()

        reply = await step
        assert isinstance(reply, StepReply)
        assert service.stats()[instance].steps == 1  # answered again from the step's cache
        assert isinstance(await env.step(Wait(seconds=0.0)), StepReply)
        assert service.stats()[instance].steps == 2
