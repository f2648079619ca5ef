"""The warm start's SFT step time by torch thread count, on a quiet machine and beside a CPU-bound program.

``dart run`` warm-starts in its own process before the services start, so the warm start may use every core
of a quiet machine; a machine shared with another program may do better with fewer threads (an OpenMP team
whose threads wait for a core at every barrier). This measures the choice on the quickstart's own workload:
its tiny policy, its oracle demonstrations of the ``train`` split and its batch size, ``--steps`` SFT steps
per setting after ``--warmup`` steps, with and without ``python3 -c "while True: pass"`` running beside.

Usage::

    uv run python benchmarks/warmstart_threads.py --threads 1 2 --steps 30

The last line of the output is one JSON object: per setting the median and mean step time, seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dart.cli.stack.config import load_run_config, load_tasks
from dart.cli.stack.warmstart import load_for_sft, write_tiny_policy
from dart.train.backend import TorchBackend
from dart.train.sft import sft_step

ROOT = Path(__file__).resolve().parents[1]
HOG = [sys.executable, "-c", "while True: pass"]


def step_times(backend: TorchBackend, demos: list[Any], batch: int, steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` SFT steps on random batches, after ``warmup`` untimed ones."""
    rng = random.Random(0)
    times = []
    for i in range(warmup + steps):
        sample = rng.sample(demos, min(batch, len(demos)))
        began = time.perf_counter()
        sft_step(backend, sample)
        if i >= warmup:
            times.append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "quickstart.yaml")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    config = load_run_config(args.config)
    tasks = load_tasks(config)
    ws = config.warm_start
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dart-ws-threads-") as scratch:
        base = Path(scratch) / "base"
        write_tiny_policy(config, tasks, base)
        backend, demos, episodes = load_for_sft(config, tasks, base)
        print(f"{len(demos)} demonstration steps from {episodes} episodes; batch {ws.batch_size}", flush=True)
        for busy in (False, True):
            hog = subprocess.Popen(HOG) if busy else None
            try:
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    times = step_times(backend, list(demos), ws.batch_size, args.steps, args.warmup)
                    row = {
                        "busy": busy,
                        "threads": threads,
                        "steps": len(times),
                        "median_s": round(statistics.median(times), 4),
                        "mean_s": round(statistics.fmean(times), 4),
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    print(json.dumps({"config": str(args.config.relative_to(ROOT)), "batch_size": ws.batch_size, "results": results}))


if __name__ == "__main__":
    main()
