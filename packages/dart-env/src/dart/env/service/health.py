"""An env instance's health, and when it is recycled.

GUI environments degrade over hundreds of episodes: a browser's memory grows, windows pile up, steps slow
down. The env service measures each instance after every episode and, past a limit of
:class:`RecycleConfig`, swaps its backend for a fresh one (a warm spare at once when one is ready) under
the same instance id, between leases, so no episode is cut.

Measured per instance (``env.instance_stats`` events carry them):

- ``episodes``: episodes released on the current backend;
- ``rss_mib``: resident memory of the backend's processes and all their descendants (Linux ``/proc``;
  a backend names its processes with :meth:`~dart.env.interface.EnvBackend.process_ids`, an in-process
  backend such as the sim has none);
- ``step_latency_ratio``: mean step latency of the latest ``latency_window`` steps over that of the first
  ``latency_window`` steps of the backend (1.0 while it has fewer than twice that many).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from dart.protocol.config import ConfigModel


class RecycleConfig(ConfigModel):
    """When an instance's backend is replaced by a fresh one (any limit reached; None: no such limit).

    Example (YAML)::

        env:
          warm_spares: 1            # so the swap is immediate
          recycle: {after_episodes: 200, max_rss_mib: 1500, max_step_latency_ratio: 3.0}
    """

    after_episodes: int | None = Field(default=None, ge=1)
    """Episodes on one backend, then it is recycled whatever its health."""
    max_rss_mib: float | None = Field(default=None, gt=0)
    """Resident memory of the backend's processes, MiB."""
    max_step_latency_ratio: float | None = Field(default=None, gt=1.0)
    """Recent mean step latency over the backend's first, e.g. 3.0: three times slower than when fresh."""
    latency_window: int = Field(default=50, ge=1)
    """Steps in each of the two means of the latency ratio."""


@dataclass
class InstanceHealth:
    """What one backend has done and how it holds up (reset when the backend is replaced)."""

    latency_window: int
    episodes: int = 0
    first_latencies: list[float] = field(default_factory=list)
    recent_latencies: deque[float] = field(default_factory=deque)

    def step(self, latency_s: float) -> None:
        """Record one step's latency."""
        if len(self.first_latencies) < self.latency_window:
            self.first_latencies.append(latency_s)
            return
        self.recent_latencies.append(latency_s)
        if len(self.recent_latencies) > self.latency_window:
            self.recent_latencies.popleft()

    @property
    def step_latency_ratio(self) -> float:
        """Recent mean step latency over the first; 1.0 until both windows are full."""
        if len(self.recent_latencies) < self.latency_window:
            return 1.0
        first = sum(self.first_latencies) / len(self.first_latencies)
        recent = sum(self.recent_latencies) / len(self.recent_latencies)
        return recent / first if first > 0 else 1.0


def recycle_reason(health: InstanceHealth, rss_mib: float, config: RecycleConfig) -> str | None:
    """Why the backend should be recycled now (``episodes``, ``memory``, ``slow_steps``), or None."""
    if config.after_episodes is not None and health.episodes >= config.after_episodes:
        return "episodes"
    if config.max_rss_mib is not None and rss_mib > config.max_rss_mib:
        return "memory"
    if config.max_step_latency_ratio is not None and health.step_latency_ratio > config.max_step_latency_ratio:
        return "slow_steps"
    return None


def processes_rss_mib(pids: Iterable[int], proc: Path = Path("/proc")) -> float:
    """Resident memory of ``pids`` and all their descendants, MiB (0.0 where ``/proc`` is not readable)."""
    roots = set(pids)
    if not roots:
        return 0.0
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.scandir(proc) if e.name.isdigit()]
    except OSError:
        return 0.0
    for entry in entries:
        try:
            # The parent is the 2nd field after the command name, which is in parentheses and may hold spaces.
            ppid = int((Path(entry.path) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, []))
    kib = 0
    for pid in seen:
        try:
            for line in (proc / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    kib += int(line.split()[1])
                    break
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile
    return kib / 1024
