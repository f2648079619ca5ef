"""Ingestion throughput of dart-data at real screen size, and the bus bytes per trajectory.

Trajectories of ``--steps`` steps (15 by default), each step a distinct 1920x1080 PNG screenshot
(a desktop-like frame: flat windows, text-like strokes and a noisy photo region, about 1-2 MB
like real screenshots), are ingested the way the data service ingests one: its screenshots and
JSON into the artifact store (:class:`dart.data.blobs.TrajectoryBlobs`, concurrent uploads) and its
row plus task statistics into the SQL index (:class:`dart.data.index.TrajectoryIndex`), one
trajectory after another. Measured for each of SQLite / PostgreSQL (embedded server) x local
directory / S3 (embedded SeaweedFS).

Bus bytes: the encoded size of the trajectory message (``dart.protocol.messages.encode``) with
every screenshot inline (base64 in the JSON, as the env service sent them before screenshots went
by reference) and with every screenshot an ``ImageRef`` to the store.

Usage: ``uv run python benchmarks/ingest_throughput.py [--trajectories N] [--steps S]``.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import struct
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from dart.data.blobs import TrajectoryBlobs
from dart.data.index import TrajectoryIndex, trajectory_row
from dart.data.stats import TaskStats
from dart.embedded.postgres import EmbeddedPostgres, postgres_available
from dart.embedded.s3 import EmbeddedS3
from dart.protocol import messages as m
from dart.protocol.messages import encode
from dart.runtime.store import ArtifactStore, LocalStore, S3Store
from dart.runtime.testing import TASK

WIDTH, HEIGHT = 1920, 1080


def screenshot(seed: int) -> bytes:
    """A desktop-like 1920x1080 PNG: windows, text-like strokes, and a noisy photo region."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (WIDTH, HEIGHT), (40, 60, 90))
    draw = ImageDraw.Draw(img)
    for _ in range(6):  # windows with title bars and lines of "text"
        x, y = int(rng.integers(0, 1400)), int(rng.integers(0, 700))
        w, h = int(rng.integers(300, 900)), int(rng.integers(200, 500))
        draw.rectangle((x, y, x + w, y + h), fill=(245, 245, 245), outline=(120, 120, 120))
        draw.rectangle((x, y, x + w, y + 28), fill=(70, 110, 180))
        for line in range(40, h - 10, 18):
            length = int(rng.integers(w // 4, w - 20))
            for word in range(x + 10, x + length, 40):
                draw.line((word, y + line, word + int(rng.integers(10, 34)), y + line), fill=(20, 20, 20), width=2)
    pixels = np.asarray(img).copy()
    # A photo-like region (wallpaper, an image in a page): smooth gradient plus sensor-like noise.
    py, px = int(rng.integers(0, HEIGHT - 400)), int(rng.integers(0, WIDTH - 600))
    grad = np.linspace(0, 160, 600, dtype=np.float32)[None, :, None]
    noise = rng.normal(0, 18, (400, 600, 3)).astype(np.float32)
    pixels[py : py + 400, px : px + 600] = np.clip(60 + grad + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def tagged(png: bytes, tag: str) -> bytes:
    """The same PNG with a tEXt chunk naming ``tag``: distinct bytes (digest) without re-encoding."""
    data = b"dart\x00" + tag.encode()
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))
    iend = png.rindex(b"IEND") - 4
    return png[:iend] + chunk + png[iend:]


def trajectory(tid: str, shots: list[bytes]) -> m.Trajectory:
    """A trajectory with one inline screenshot per step (as the env service sends them)."""
    steps = [
        m.StepRecord(
            index=i,
            policy_version=1,
            observation=m.Observation(
                screenshot=m.InlineImage(png=tagged(png, f"{tid}/{i}"), width=WIDTH, height=HEIGHT)
            ),
            prompt_token_ids=list(range(1200)),
            response_token_ids=list(range(40)),
            response_logprobs=[-0.5] * 40,
            response_entropy=[1.0] * 40,
            response_text="Action: click(start_box='(100,200)')",
            action=m.Click(x=0.1, y=0.2),
        )
        for i, png in enumerate(shots)
    ]
    return m.Trajectory(
        trajectory_id=tid,
        work_id=f"w-{tid}",
        task=TASK,
        group_id=f"g-{tid}",
        rollout_index=0,
        group_size=1,
        steps=steps,
        status=m.TrajectoryStatus.OK,
        reward=1.0,
        success=True,
        min_policy_version=1,
        max_policy_version=1,
        started_at=0.0,
        finished_at=1.0,
    )


@contextmanager
def stores(stack: ExitStack, kind: str, tmp: Path) -> Iterator[ArtifactStore]:
    if kind == "local":
        yield LocalStore(tmp / f"store-{time.monotonic_ns()}")
        return
    s3 = stack.enter_context(EmbeddedS3())
    store = S3Store(
        "bench",
        endpoint=s3.endpoint,
        access_key=s3.access_key,
        secret_key=s3.secret_key,
        secure=False,
        region=s3.region,
    )
    with store:
        yield store


def ingest(store: ArtifactStore, url: str, trajs: list[m.Trajectory], concurrency: int) -> dict[str, Any]:
    """Ingest ``trajs`` one after another; trajectories/s and MB/s of screenshots."""
    blobs = TrajectoryBlobs(store, upload_concurrency=concurrency)
    index = TrajectoryIndex(url)
    index.migrate()
    stats = TaskStats(TASK.task_id)
    shot_bytes = sum(len(s.observation.screenshot.png) for t in trajs for s in t.steps)  # type: ignore[union-attr]
    start = time.perf_counter()
    for t in trajs:
        stats = stats.recorded(True, len(t.steps), window=32)
        assert index.store_trajectory(trajectory_row(blobs.put(t)), stats)
    elapsed = time.perf_counter() - start
    assert index.count_trajectories() == len(trajs)
    blobs.close()
    index.close()
    return {
        "trajectories_per_s": round(len(trajs) / elapsed, 3),
        "screenshot_mb_per_s": round(shot_bytes / elapsed / 1e6, 1),
        "seconds": round(elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=6)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--upload-concurrency", type=int, default=8)
    args = parser.parse_args()

    t0 = time.perf_counter()
    base = [screenshot(seed) for seed in range(args.steps)]
    print(
        f"generated {len(base)} screenshots in {time.perf_counter() - t0:.1f}s,"
        f" mean {np.mean([len(b) for b in base]) / 1e6:.2f} MB"
    )
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dart-ingest-bench-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        databases = {"sqlite": lambda: f"sqlite:///{tmp / f'db-{time.monotonic_ns()}.sqlite3'}"}
        if postgres_available():
            pg = stack.enter_context(EmbeddedPostgres())
            databases["postgresql"] = lambda: pg.create_database(f"bench_{time.monotonic_ns()}")
        else:
            print("PostgreSQL not installed: skipping it (install Debian's 'postgresql')")
        for store_kind in ("local", "s3"):
            with ExitStack() as store_stack, stores(store_stack, store_kind, tmp) as store:
                for db_kind, make_url in databases.items():
                    trajs = [trajectory(f"{store_kind}-{db_kind}-{i}", base) for i in range(args.trajectories)]
                    for concurrency in (1, args.upload_concurrency):
                        prefix_trajs = [
                            t.model_copy(update={"trajectory_id": f"c{concurrency}-{t.trajectory_id}"}) for t in trajs
                        ]
                        name = f"{db_kind}+{store_kind}+uploads{concurrency}"
                        results[name] = ingest(store, make_url(), prefix_trajs, concurrency)
                        print(name, results[name], flush=True)

    sample = trajectory("bus", base)
    inline = len(encode(sample))
    with tempfile.TemporaryDirectory() as tmp_name:
        by_ref = len(encode(TrajectoryBlobs(LocalStore(Path(tmp_name))).put(sample).trajectory))
    largest_inline_message = max(len(encode(sample.model_copy(update={"steps": [s]}))) for s in sample.steps)
    figures = {
        "benchmark": "ingest_throughput",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "steps": args.steps,
        "trajectories": args.trajectories,
        "screenshot": f"{WIDTH}x{HEIGHT}",
        "mean_png_bytes": int(np.mean([len(b) for b in base])),
        "ingest": results,
        "bus_bytes_per_trajectory_inline": inline,
        "bus_bytes_per_trajectory_by_reference": by_ref,
        "bus_bytes_one_step_inline": largest_inline_message,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
