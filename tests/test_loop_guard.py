"""The event-loop guard of the root conftest: blocking fails a test, waiting for a CPU does not."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit

# The root conftest's module is not reliably importable by name (import-mode importlib, one conftest per
# package), so its guard is reached through the function it installed on asyncio's Handle.
root_conftest = SimpleNamespace(**asyncio.events.Handle._run.__globals__)
assert root_conftest.__file__ == str(Path(__file__).resolve().parents[1] / "conftest.py"), "guard not installed"


def _run_in_fresh_loop(callback: Callable[[], None], setup: Callable[[], None] = lambda: None) -> list[str]:
    """Runs ``callback`` as one event-loop callback in a new thread; returns what the guard recorded."""
    recorded: list[str] = []

    def main() -> None:
        setup()
        loop = asyncio.new_event_loop()
        try:
            loop.call_soon(callback)
            loop.call_soon(loop.stop)
            loop.run_forever()
        finally:
            loop.close()

    thread = threading.Thread(target=main)
    thread.start()
    thread.join()
    recorded.extend(root_conftest._slow_callbacks)
    root_conftest._slow_callbacks.clear()  # these were provoked on purpose
    return recorded


def test_a_sleeping_callback_is_caught() -> None:
    slow = _run_in_fresh_loop(lambda: time.sleep(root_conftest.BLOCKING_LIMIT_S + 0.3))
    assert len(slow) == 1 and "blocked" in slow[0]


def test_a_short_callback_is_not() -> None:
    assert _run_in_fresh_loop(lambda: time.sleep(0.01)) == []


def _compute_for(cpu_s: float) -> Callable[[], None]:
    def burst() -> None:
        deadline = time.thread_time() + cpu_s
        while time.thread_time() < deadline:
            pass

    return burst


def test_computing_past_the_limit_at_the_reference_speed_is_caught() -> None:
    """CPU work is charged at the reference machine's speed: past the limit there, past it here."""
    limit, slowness = root_conftest.BLOCKING_LIMIT_S, root_conftest.MACHINE_SLOWNESS
    slow = _run_in_fresh_loop(_compute_for(limit * slowness + 0.3))
    assert len(slow) == 1 and f"on a machine {slowness:.2f}x" in slow[0], slow


def test_cpu_time_is_charged_at_the_reference_speed() -> None:
    charged = root_conftest.charged_blocking_s
    # 2 s of wall: 0.5 s waiting for a CPU, 1 s computing on a machine twice as slow, 0.5 s asleep.
    assert charged(2.0, 0.5, 1.0, 2.0) == pytest.approx(0.5 + 0.5)
    # On the reference machine CPU time counts in full; a sleep counts in full anywhere.
    assert charged(1.5, 0.0, 1.5, 1.0) == pytest.approx(1.5)
    assert charged(1.5, 0.0, 0.0, 3.0) == pytest.approx(1.5)
    # A clock that reads more CPU than the callback was on a CPU charges no more than that time.
    assert charged(1.0, 0.5, 0.9, 1.0) == pytest.approx(0.5)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_a_starved_callback_is_not_blamed() -> None:
    """A short CPU burst made to take seconds of wall time by a CPU hog on the same core passes the guard."""
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"],
    )
    walls: list[float] = []

    def starve_this_thread() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only (Linux): share one core with the hog
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # and lose every contest for it

    def burst() -> None:
        started = time.perf_counter()
        deadline = time.thread_time() + 0.05  # 50 ms of CPU, however long it takes to get them
        while time.thread_time() < deadline:
            pass
        walls.append(time.perf_counter() - started)

    try:
        time.sleep(0.2)  # let the hog occupy the core
        slow = _run_in_fresh_loop(burst, setup=starve_this_thread)
    finally:
        hog.kill()
        hog.wait()
    # The test shows something only if starvation really stretched the burst past the limit.
    assert walls[0] > root_conftest.BLOCKING_LIMIT_S, f"the burst was not starved (wall {walls[0]:.2f}s)"
    assert slow == []
