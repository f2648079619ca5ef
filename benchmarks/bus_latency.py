"""Bus and artifact-store micro-benchmark.

Starts an embedded nats-server and S3 server on loopback, then measures:
- core NATS request/reply latency (median, p99) for 1 KB and 200 KB payloads through the typed
  bus client (encode, validate, reply, validate);
- JetStream publish-with-ack throughput, one publish at a time and with 64 in flight;
- S3 put/get throughput of a 50 MB object through the streaming ArtifactStore API.

Usage: ``uv run python benchmarks/bus_latency.py [--requests N] [--s3-mb MB]``.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Iterator
from typing import Literal

from dart.embedded.nats import EmbeddedNats
from dart.embedded.s3 import EmbeddedS3
from dart.protocol.messages import Message
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.store import S3Store


class Blob(Message):
    """Benchmark payload."""

    kind: Literal["bench.blob"] = "bench.blob"
    data: bytes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def bench_request_reply(bus: Bus, size: int, n: int) -> dict[str, float]:
    subject = bus.subjects.bench(f"echo{size}")

    async def echo(req: Blob) -> Blob:
        return req

    service = await bus.serve(subject, Blob, echo)
    msg = Blob(data=os.urandom(size))
    for _ in range(min(200, n)):  # warm up connections, caches and pydantic
        await bus.request(subject, msg, Blob)
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        reply = await bus.request(subject, msg, Blob)
        samples.append(time.perf_counter() - t0)
    assert reply.data == msg.data
    await service.stop()
    return {
        "median_ms": statistics.median(samples) * 1e3,
        "p99_ms": percentile(samples, 0.99) * 1e3,
        "requests": n,
    }


async def bench_jetstream(bus: Bus, n: int, in_flight: int) -> float:
    await bus.ensure_stream("work", duplicate_window_s=60)
    subject = bus.subjects.stream_subject("work")
    msg = Blob(data=os.urandom(1024))
    sem = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with sem:
            await bus.js_publish(subject, msg, msg_id=uuid.uuid4().hex)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - t0)


def chunks(total: int, chunk: int, seed: int) -> Iterator[bytes]:
    block = hashlib.sha256(str(seed).encode()).digest() * (chunk // 32)
    sent = 0
    i = 0
    while sent < total:
        # Vary each chunk so the store cannot dedupe or compress it away.
        piece = (i.to_bytes(8, "little") + block)[: min(chunk, total - sent)]
        yield piece
        sent += len(piece)
        i += 1


def bench_s3(server: EmbeddedS3, megabytes: int) -> dict[str, float]:
    store = S3Store(
        endpoint=server.endpoint,
        bucket="bench",
        access_key=server.access_key,
        secret_key=server.secret_key,
        secure=False,
        create_bucket=True,
    )
    size = megabytes * 1024 * 1024
    t0 = time.perf_counter()
    info = store.put_stream("bench/blob.bin", chunks(size, 1024 * 1024, 7), size=size)
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = 0
    for piece in store.get_stream("bench/blob.bin", verify=True):
        got += len(piece)
    get_s = time.perf_counter() - t0
    assert got == size and info.size == size
    store.delete("bench/blob.bin")
    return {"object_mb": megabytes, "put_mb_s": megabytes / put_s, "get_mb_s": megabytes / get_s}


async def run_bus(url: str, requests: int, js_messages: int) -> dict[str, object]:
    bus = await Bus.connect(BusConfig(url=url, run=f"bench{uuid.uuid4().hex[:8]}"))
    try:
        small = await bench_request_reply(bus, 1024, requests)
        large = await bench_request_reply(bus, 200 * 1024, max(200, requests // 5))
        js_serial = await bench_jetstream(bus, max(500, js_messages // 10), in_flight=1)
        js_pipelined = await bench_jetstream(bus, js_messages, in_flight=64)
    finally:
        await bus.close()
    return {
        "rr_1kb": small,
        "rr_200kb": large,
        "js_publish_ack_msgs_s_serial": js_serial,
        "js_publish_ack_msgs_s_64_in_flight": js_pipelined,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000, help="request/reply round trips for 1 KB")
    parser.add_argument("--js-messages", type=int, default=10000, help="JetStream publishes (64 in flight)")
    parser.add_argument("--s3-mb", type=int, default=50, help="S3 object size in MB")
    args = parser.parse_args()

    with EmbeddedNats() as nats_server:
        bus_figures = asyncio.run(run_bus(nats_server.url, args.requests, args.js_messages))
    with EmbeddedS3() as s3_server:
        s3_figures = bench_s3(s3_server, args.s3_mb)

    rr1, rr200 = bus_figures["rr_1kb"], bus_figures["rr_200kb"]
    assert isinstance(rr1, dict) and isinstance(rr200, dict)
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}")
    for label, rr in (("1 KB", rr1), ("200 KB", rr200)):
        print(
            f"request/reply {label:>6}: median {rr['median_ms']:.3f} ms   p99 {rr['p99_ms']:.3f} ms"
            f"   (n={rr['requests']:.0f})"
        )
    print(
        f"JetStream publish+ack: {bus_figures['js_publish_ack_msgs_s_serial']:.0f} msg/s one at a time, "
        f"{bus_figures['js_publish_ack_msgs_s_64_in_flight']:.0f} msg/s with 64 in flight (1 KB)"
    )
    print(
        f"S3 {s3_figures['object_mb']:.0f} MB object:  put {s3_figures['put_mb_s']:.1f} MB/s"
        f"   get {s3_figures['get_mb_s']:.1f} MB/s"
    )
    print(json.dumps({"benchmark": "bus_latency", **bus_figures, "s3": s3_figures}))


if __name__ == "__main__":
    main()
