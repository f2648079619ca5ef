"""Env backend throughput: reset and step latency, steps per second with concurrent instances, memory.

For each backend (``sim`` with its latency model off, ``miniwob`` in headless Chromium, the local
X ``desktop`` behind its VM-server HTTP API):

- reset and step latency (median, p95) over ``--steps`` steps of a fixed, seeded action mix
  (clicks, typing, select-all, scrolls, drags); an episode that ends (a button was hit) or reaches
  ``EPISODE_STEPS`` steps is reset, and that reset is timed too;
- env steps per second with 1, 2 and 4 instances stepping concurrently (``asyncio.gather`` over
  instances; every backend does its blocking work on its own thread), resets included in the time;
- memory per instance: RSS and PSS of the instance's processes (chromedriver and its Chromium
  tree; Xvfb, window manager and VM server trees), read from ``/proc``. RSS counts pages shared
  between processes once per process; PSS splits them, so it is the better per-instance figure.
  The sim runs inside this process: its figure is this process's RSS growth per instance.

Usage: ``uv run python benchmarks/env_throughput.py [--backends sim,miniwob,desktop] [--steps N]
[--instances 1,2,4] [--quick]``. The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import random
import shutil
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dart.env.interface import EnvBackend
from dart.protocol.messages import Action, Click, Drag, Hotkey, Scroll, ScrollDirection, TaskSpec, Type

EPISODE_STEPS = 10
"""Steps after which an episode is reset even if it has not ended."""


def action_mix(seed: int, n: int) -> list[Action]:
    """``n`` actions of the fixed mix: 40% clicks, 20% typing, 10% ctrl+a, 20% scrolls, 10% drags."""
    rng = random.Random(seed)
    actions: list[Action] = []
    for _ in range(n):
        r = rng.random()
        x, y = round(rng.uniform(0.05, 0.95), 3), round(rng.uniform(0.3, 0.95), 3)
        if r < 0.4:
            actions.append(Click(x=x, y=y))
        elif r < 0.6:
            actions.append(Type(text="hello"))
        elif r < 0.7:
            actions.append(Hotkey(keys=("ctrl", "a")))
        elif r < 0.9:
            actions.append(Scroll(x=x, y=y, direction=rng.choice([ScrollDirection.DOWN, ScrollDirection.UP])))
        else:
            actions.append(Drag(x1=x, y1=y, x2=round(rng.uniform(0.05, 0.95), 3), y2=round(rng.uniform(0.3, 0.95), 3)))
    return actions


# -- memory, from /proc ----------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(p) for p in task.read_text().split()]
        except OSError:  # the task ended meanwhile
            continue
    return out


def process_tree(pids: Sequence[int]) -> list[int]:
    """``pids`` and all their descendants (via ``/proc/<pid>/task/*/children``)."""
    seen: list[int] = []
    stack = list(pids)
    while stack:
        pid = stack.pop()
        if pid in seen or not Path(f"/proc/{pid}").exists():
            continue
        seen.append(pid)
        stack += _children(pid)
    return seen


def _kb(path: str, key: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_memory_mb(pids: Sequence[int]) -> tuple[float, float, int]:
    """``(RSS MB, PSS MB, process count)`` of the process trees rooted at ``pids``."""
    tree = process_tree(pids)
    rss = sum(_kb(f"/proc/{p}/status", "VmRSS") for p in tree)
    pss = sum(_kb(f"/proc/{p}/smaps_rollup", "Pss") for p in tree)
    return rss / 1024, pss / 1024, len(tree)


def self_rss_mb() -> float:
    """This process's RSS, MB."""
    return _kb("/proc/self/status", "VmRSS") / 1024


# -- targets: one env instance each ----------------------------------------------------------


class Target(ABC):
    """One env instance under test. Lifecycle: start -> (reset, step...)... -> close."""

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def reset(self, episode: int) -> None: ...

    @abstractmethod
    async def step(self, action: Action) -> bool:
        """Execute one action and observe the screen; True when the episode ended."""

    @abstractmethod
    def pids(self) -> list[int]:
        """Root processes of the instance (empty for in-process backends)."""

    @abstractmethod
    async def close(self) -> None: ...


class EnvTarget(Target):
    """An :class:`EnvBackend` built through the env service's registry, cycling through ``tasks``."""

    def __init__(self, backend: str, tasks: Sequence[TaskSpec], stream: int) -> None:
        from dart.env.interface import ENV_BACKENDS
        from dart.env.service.config import EnvServiceConfig

        config = EnvServiceConfig(backend=backend, pool="bench")  # sim default: no simulated latency
        self.env: EnvBackend = ENV_BACKENDS.get(backend)(config, stream)
        self.tasks = list(tasks)

    async def start(self) -> None:
        await self.env.start()

    async def reset(self, episode: int) -> None:
        await self.env.reset(self.tasks[episode % len(self.tasks)], seed=episode)

    async def step(self, action: Action) -> bool:
        _, done, _ = await self.env.step(action)
        return done

    def pids(self) -> list[int]:
        browser = getattr(self.env, "browser", None)
        return [browser.driver_pid] if browser is not None else []

    async def close(self) -> None:
        await self.env.close()


class DesktopTarget(Target):
    """A local X desktop (Xvfb + openbox + VM server): a step is ``POST /dart/action`` plus ``GET
    /screenshot`` (what an env step returns); a reset is the desktop's revert plus a screenshot."""

    def __init__(self, width: int, height: int) -> None:
        import requests

        from dart.env.desktop import DesktopConfig, XDesktop

        self.desk = XDesktop(DesktopConfig(width=width, height=height))
        self.http = requests.Session()

    async def start(self) -> None:
        await asyncio.to_thread(self.desk.start)
        self.http.headers.update(self.desk.headers)  # every route but /dart/health needs the desktop's token

    def _screenshot(self) -> None:
        from PIL import Image

        reply = self.http.get(f"{self.desk.url}/screenshot", timeout=30)
        reply.raise_for_status()
        Image.open(io.BytesIO(reply.content)).verify()

    async def reset(self, episode: int) -> None:
        def reset() -> None:
            self.desk.revert()
            self._screenshot()

        await asyncio.to_thread(reset)

    async def step(self, action: Action) -> bool:
        def step() -> None:
            reply = self.http.post(f"{self.desk.url}/dart/action", data=action.model_dump_json(), timeout=30)
            reply.raise_for_status()
            self._screenshot()

        await asyncio.to_thread(step)
        return False

    def pids(self) -> list[int]:
        return [pid for pid in self.desk.pids.values() if pid]

    async def close(self) -> None:
        await asyncio.to_thread(self.desk.close)


def make_target(backend: str, stream: int) -> Target:
    """A fresh, unstarted instance of ``backend``."""
    if backend == "sim":
        from dart.env.sim import load_builtin_suite

        return EnvTarget("sim", load_builtin_suite("smoke").tasks, stream)
    if backend == "miniwob":
        from dart.env.miniwob.catalog import load_builtin_suite as miniwob_suite

        return EnvTarget("miniwob", miniwob_suite("smoke").tasks, stream)
    if backend == "desktop":
        return DesktopTarget(1280, 720)
    raise ValueError(f"unknown backend {backend!r}: choose sim, miniwob or desktop")


def unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run here, or None."""
    if backend == "miniwob" and not (shutil.which("chromium") and shutil.which("chromedriver")):
        return "chromium / chromedriver not installed"
    if backend == "desktop":
        if not shutil.which("Xvfb"):
            return "Xvfb not installed"
        try:
            import dart.env.desktop  # noqa: F401
        except ImportError as exc:
            return f"dart.env.desktop not importable: {exc}"
    return None


# -- measurement -----------------------------------------------------------------------------


async def drive(target: Target, actions: Sequence[Action], resets: list[float], steps: list[float]) -> None:
    """Step ``target`` through ``actions``, resetting at episode ends; appends latencies (seconds)."""
    episode, in_episode = 0, 0
    t0 = time.perf_counter()
    await target.reset(episode)
    resets.append(time.perf_counter() - t0)
    for action in actions:
        if in_episode >= EPISODE_STEPS:
            episode, in_episode = episode + 1, 0
            t0 = time.perf_counter()
            await target.reset(episode)
            resets.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        done = await target.step(action)
        steps.append(time.perf_counter() - t0)
        in_episode += 1
        if done:
            in_episode = EPISODE_STEPS


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median and p95 in milliseconds."""
    if not samples:
        return {"median_ms": float("nan"), "p95_ms": float("nan"), "n": 0}
    p95 = statistics.quantiles(samples, n=20, method="inclusive")[-1] if len(samples) > 1 else samples[0]
    return {"median_ms": round(statistics.median(samples) * 1000, 2), "p95_ms": round(p95 * 1000, 2), "n": len(samples)}


async def bench_backend(backend: str, steps: int, instance_counts: Sequence[int]) -> dict[str, Any]:
    """Every figure of one backend; instances are started once and reused across concurrency levels."""
    most = max(instance_counts)
    t0 = time.perf_counter()
    targets = [make_target(backend, 0)]
    await targets[0].start()
    start_s = time.perf_counter() - t0
    try:
        # Warm-up: the first reset loads pages and imports modules; not part of any figure.
        await targets[0].reset(0)
        rss_one = self_rss_mb()
        targets += [make_target(backend, i) for i in range(1, most)]
        await asyncio.gather(*(t.start() for t in targets[1:]))
        await asyncio.gather(*(t.reset(0) for t in targets[1:]))
        rss_all = self_rss_mb()
        resets: list[float] = []
        latencies: list[float] = []
        await drive(targets[0], action_mix(0, steps), resets, latencies)
        out: dict[str, Any] = {
            "start_s": round(start_s, 2),
            "reset": summary(resets),
            "step": summary(latencies),
            "steps_per_s": {},
        }
        for count in instance_counts:
            t0 = time.perf_counter()
            sink: list[float] = []
            await asyncio.gather(*(drive(t, action_mix(i + 1, steps), [], sink) for i, t in enumerate(targets[:count])))
            out["steps_per_s"][str(count)] = round(len(sink) / (time.perf_counter() - t0), 2)
        mems = [tree_memory_mb(t.pids()) for t in targets]
        if any(t.pids() for t in targets):
            out["memory_per_instance"] = {
                "rss_mb": round(statistics.mean(m[0] for m in mems), 1),
                "pss_mb": round(statistics.mean(m[1] for m in mems), 1),
                "processes": round(statistics.mean(m[2] for m in mems), 1),
            }
        else:
            # In-process: what each further instance adds to this process, measured right after the
            # instances were created (None with a single instance).
            growth = round((rss_all - rss_one) / (most - 1), 1) if most > 1 else None
            out["memory_per_instance"] = {"in_process_rss_growth_mb": growth, "processes": 0}
        return out
    finally:
        await asyncio.gather(*(t.close() for t in targets), return_exceptions=True)


def print_table(results: dict[str, Any], counts: Sequence[int]) -> None:
    head = ["backend", "reset med/p95 ms", "step med/p95 ms", *[f"steps/s x{c}" for c in counts], "MB/instance"]
    rows = [head]
    for backend, r in results.items():
        if "skipped" in r:
            rows.append([backend, f"skipped: {r['skipped']}", *[""] * (len(head) - 2)])
            continue
        mem = r["memory_per_instance"]
        mem_s = (
            f"{mem['pss_mb']} PSS / {mem['rss_mb']} RSS"
            if "pss_mb" in mem
            else f"{mem['in_process_rss_growth_mb']} (in-process)"
        )
        rows.append(
            [
                backend,
                f"{r['reset']['median_ms']} / {r['reset']['p95_ms']}",
                f"{r['step']['median_ms']} / {r['step']['p95_ms']}",
                *[str(r["steps_per_s"].get(str(c), "-")) for c in counts],
                mem_s,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="sim,miniwob,desktop", help="comma-separated: sim, miniwob, desktop")
    parser.add_argument("--steps", type=int, default=200, help="steps per instance per measurement")
    parser.add_argument("--instances", default="1,2,4", help="concurrency levels, comma-separated")
    parser.add_argument("--quick", action="store_true", help="30 steps and 1,2 instances (a smoke check)")
    args = parser.parse_args()
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never download anything
    steps = 30 if args.quick else args.steps
    counts = [1, 2] if args.quick else sorted({int(c) for c in args.instances.split(",") if c.strip()})
    if steps < 1 or not counts or min(counts) < 1:
        parser.error("--steps and --instances must be positive")
    results: dict[str, Any] = {}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        reason = unavailable(backend)
        if reason is not None:
            results[backend] = {"skipped": reason}
            continue
        results[backend] = asyncio.run(bench_backend(backend, steps, counts))
    print_table(results, counts)
    print(
        json.dumps(
            {
                "benchmark": "env_throughput",
                "steps_per_instance": steps,
                "instances": counts,
                "episode_steps": EPISODE_STEPS,
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "backends": results,
            }
        )
    )


if __name__ == "__main__":
    main()
