"""The warm start's time guard: its steps decide how long it runs, the guard only stops a stuck machine.

A slow or busy machine takes longer per SFT step but must still take every step (a cut warm start leaves
RL with a weaker policy, and the run's figures then depend on the machine's load). So the limit scales
with the machine: the *reference step time* is the median duration of the first
:data:`REFERENCE_STEPS` steps, the expected time is that times the configured steps, and the guard
cuts the warm start once its steps have taken longer than ``warm_start.max_slowdown`` times the expected
time, and never before ``warm_start.guard_floor_s``. A machine that stays as slow as it began is never cut;
one whose steps become ``max_slowdown`` times slower than they began (swapping, a stalled device) is.

``warm_start.max_seconds``, when set, is a hard wall-clock limit on top of the guard, as it always was.

Both are checked after each step: a step that never returns is not interrupted.

Lifecycle: built per warm start -> :meth:`WarmStartGuard.step_done` after every step, which says whether
to stop -> :attr:`cut_by` says what stopped it (None: every step was taken).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

REFERENCE_STEPS = 10
"""How many first steps measure the machine's step time (their median: one slow first step, which
allocates and warms caches, does not inflate it)."""

CutBy = Literal["guard", "max_seconds"]


def guard_limit_s(reference_step_s: float, steps: int, max_slowdown: float, floor_s: float) -> float:
    """The guard's limit on the warm start's SFT time, seconds: ``max_slowdown`` x the expected time
    (``reference_step_s`` x ``steps``), and at least ``floor_s``."""
    return max(floor_s, max_slowdown * reference_step_s * steps)


@dataclass
class WarmStartGuard:
    """Decides, after each SFT step, whether the warm start must stop (see the module docstring).

    Attributes:
        steps: The configured SFT steps.
        max_slowdown: How many times the expected time the steps may take before the guard cuts them.
        floor_s: The guard never cuts before this many seconds.
        max_seconds: A hard wall-clock limit, seconds (``warm_start.max_seconds``); None: none.
    """

    steps: int
    max_slowdown: float
    floor_s: float
    max_seconds: float | None = None
    done: int = 0
    """Steps taken so far."""
    elapsed_s: float = 0.0
    """Seconds the steps have taken so far."""
    cut_by: CutBy | None = None
    """What stopped the warm start before its last step; None while it has not been stopped."""
    _first: list[float] = field(default_factory=list)

    @property
    def limit_s(self) -> float:
        """The guard's current limit, seconds (infinite before the first step: nothing is measured)."""
        if not self._first:
            return float("inf")
        return guard_limit_s(statistics.median(self._first), self.steps, self.max_slowdown, self.floor_s)

    def step_done(self, step_s: float) -> bool:
        """Record one step's duration, seconds; True when the warm start must stop now (:attr:`cut_by` says
        why). The last configured step never counts as cut."""
        self.done += 1
        self.elapsed_s += step_s
        if len(self._first) < REFERENCE_STEPS:
            self._first.append(step_s)
        if self.done >= self.steps:
            return False
        if self.max_seconds is not None and self.elapsed_s > self.max_seconds:
            self.cut_by = "max_seconds"
        elif self.elapsed_s > self.limit_s:
            self.cut_by = "guard"
        return self.cut_by is not None

    def report(self) -> dict[str, Any]:
        """The summary's fields: ``warm_start_cut`` (and, when cut, ``warm_start_cut_by`` and the limit that
        acted, ``warm_start_limit_s``) beside the steps planned."""
        fields: dict[str, Any] = {"warm_start_cut": self.cut_by is not None, "warm_start_planned_steps": self.steps}
        if self.cut_by is not None:
            limit = self.max_seconds if self.cut_by == "max_seconds" else self.limit_s
            fields.update(warm_start_cut_by=self.cut_by, warm_start_limit_s=round(float(limit or 0.0), 1))
        return fields


def warm_start_row(info: dict[str, Any]) -> str | None:
    """The final table's warm-start row from the summary's fields: the steps taken, and whether it was cut."""
    steps = info.get("warm_start_steps")
    if steps is None:
        return None
    planned = info.get("warm_start_planned_steps", steps)
    if not info.get("warm_start_cut"):
        return f"{steps} steps" + (" (cached)" if info.get("warm_start_cached") else "")
    return f"CUT at {steps} of {planned} steps by {info.get('warm_start_cut_by')} ({info.get('warm_start_limit_s')} s)"
