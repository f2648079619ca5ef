"""How many torch threads the warm start's SFT steps run on: the count its own steps measure fastest.

The warm start runs in ``dart run``'s process before the services start, so on a quiet machine it may use
every core; beside another busy program, an OpenMP team of as many threads as cores waits at every barrier
for the thread that has no core, and a step gets slower than on one thread. Measured on the 2-core CPU
machine (``benchmarks/warmstart_threads.py``, the quickstart's workload, 2026-11-29): quiet, 0.40 s a step
on 1 thread and 0.27 s on 2; beside ``python3 -c "while True: pass"``, 0.41 s on 1 and 0.78 s on 2.

So the choice is measured, not configured: :class:`ThreadChooser` opens each period of ``period`` steps
with ``probe_steps`` steps on each candidate count (real training steps: nothing is thrown away), then runs
the rest of the period on the count whose probe steps were fastest (by median). A machine whose load
changes during the warm start is measured again at the next period.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch


def candidate_counts(cpus: int) -> list[int]:
    """The thread counts worth trying on ``cpus`` cores: one, half of them and all of them (distinct)."""
    return sorted({1, max(1, cpus // 2), max(1, cpus)})


class ThreadChooser:
    """Sets the torch thread count before each SFT step and learns from its time; see the module docstring.

    Args:
        candidates: Thread counts to choose among (one: it runs every step).
        period: Steps between two measurements.
        probe_steps: Steps timed on each candidate at the start of a period.
    """

    def __init__(self, candidates: Sequence[int], *, period: int = 100, probe_steps: int = 2) -> None:
        if not candidates or min(candidates) < 1:
            raise ValueError(f"thread counts must be at least 1, got {list(candidates)}")
        if period < len(candidates) * probe_steps:
            raise ValueError(f"a period of {period} steps cannot hold {probe_steps} probe steps per candidate")
        self.candidates = list(dict.fromkeys(candidates))
        self.period = period
        self.probe_steps = probe_steps
        self.chosen = self.candidates[-1]
        self.choices: list[int] = []
        """The count chosen in each period, in order."""
        self._step = 0
        self._current = self.chosen
        self._timed: dict[int, list[float]] = {}
        self._used: Counter[int] = Counter()

    def before_step(self) -> int:
        """Set and return the thread count of the next step."""
        at = self._step % self.period
        if at == 0:
            self._timed = {}
        probing = at < len(self.candidates) * self.probe_steps
        self._current = self.candidates[at // self.probe_steps] if probing else self.chosen
        if torch.get_num_threads() != self._current:
            torch.set_num_threads(self._current)
        return self._current

    def after_step(self, seconds: float) -> None:
        """Record the step's time; after a period's last probe step, choose the fastest count."""
        at = self._step % self.period
        self._used[self._current] += 1
        self._step += 1
        probes = len(self.candidates) * self.probe_steps
        if at < probes:
            self._timed.setdefault(self._current, []).append(seconds)
        if at == probes - 1:
            self.chosen = min(self._timed, key=lambda n: statistics.median(self._timed[n]))
            self.choices.append(self.chosen)

    def report(self) -> dict[str, Any]:
        """The summary's fields: the counts chosen per period and the steps run on each count."""
        return {
            "warm_start_threads_chosen": list(self.choices),
            "warm_start_steps_by_threads": {str(n): c for n, c in sorted(self._used.items())},
        }
