"""What the end-to-end tests that drive ``dart run`` as a process share: waiting on a condition of the run,
reading its telemetry events, and checking that an engine's weight update overlapped another's serving.

Imported by those tests with this folder on ``sys.path`` (it is not a test module).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dart.runtime.telemetry import read_jsonl


def wait_for(run: subprocess.Popen[str], condition: Callable[[], Any], what: str, *, limit_s: float) -> Any:
    """``condition()``'s first truthy value, polled every 0.5 s while ``run`` is alive.

    Raises:
        AssertionError: ``run`` ended first, or ``limit_s`` passed (a hung run; a loaded machine is slow, not stuck).
    """
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if run.poll() is not None:
            raise AssertionError(f"dart run ended (code {run.returncode}) before {what}")
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {limit_s:g}s")


def events(run_dir: Path, service: str, name: str) -> list[dict[str, Any]]:
    """The telemetry events ``name`` that ``service`` (its telemetry file's stem) recorded so far."""
    path = run_dir / "telemetry" / f"{service}.jsonl"
    return [r for r in read_jsonl(path, types={"event"}) if r["name"] == name] if path.is_file() else []


def assert_an_engine_updated_while_another_served(
    records: Sequence[dict[str, Any]], *, successful_only: bool = False
) -> None:
    """The rollout service's telemetry ``records`` show per-engine synchronization: some engine's weight update
    (``engine.update.start`` to ``.end``; with ``successful_only`` the ones that loaded) overlapped another
    engine's ``engine.generate`` span, and no two engines were updating at once."""
    starts: dict[tuple[str, int], int] = {}
    updates: list[tuple[str, int, int]] = []
    for r in records:
        if r["type"] == "event" and r["name"] in ("engine.update.start", "engine.update.end"):
            key = (r["attributes"]["engine_id"], r["attributes"]["version"])
            if r["name"] == "engine.update.start":
                starts[key] = r["ts_unix_ns"]
            elif key in starts and (r["attributes"]["ok"] or not successful_only):
                updates.append((key[0], starts[key], r["ts_unix_ns"]))
    generates = [
        (r["attributes"]["dart.engine_id"], r["start_unix_ns"], r["end_unix_ns"])
        for r in records
        if r["type"] == "span" and r["name"] == "engine.generate"
    ]
    assert updates, f"no {'successful ' if successful_only else ''}engine weight update was recorded"
    overlapping = [
        (engine, start, end)
        for engine, start, end in updates
        if any(other != engine and g_start < end and g_end > start for other, g_start, g_end in generates)
    ]
    assert overlapping, "no engine served a request while another engine was updating"
    # Decoupled mode never takes every engine down at once.
    for _, start, end in updates:
        busy = {e for e, s, t in updates if s < end and t > start}
        assert len(busy) < 2, f"engines {busy} updated at the same time"
