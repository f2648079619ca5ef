"""When ``dart run``'s RL phase ends on its own terms, and why.

The phase lasts ``run.rl_duration_s``; while fewer than ``run.min_versions`` versions are published it goes
on, up to ``run.max_rl_duration_s`` (None: 4 x ``rl_duration_s``). So a config with a short
``rl_duration_s`` and ``min_versions`` learns the same amount on a slow machine as on a fast one, taking
longer. What ended it (the summary's ``rl_ended_by``):

- ``duration``: ``rl_duration_s`` passed with the versions wanted already out (or none wanted);
- ``versions``: the phase outlived ``rl_duration_s`` waiting for ``min_versions``, and they came;
- ``max_duration``: they did not come within ``max_rl_duration_s``.

(``signal`` and ``failure`` are decided by ``dart run`` itself, not by the clock.)

Lifecycle: built when the RL window opens -> :meth:`RlPhaseClock.ended_by` at each progress poll, with the
time and the newest version -> the first reason it returns ends the phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RlEndedBy = Literal["duration", "versions", "max_duration"]


@dataclass
class RlPhaseClock:
    """The RL phase's end condition (see the module docstring); times are ``time.monotonic()`` seconds.

    Attributes:
        began: When the RL window opened.
        duration_s: ``run.rl_duration_s``.
        min_versions: ``run.min_versions``.
        max_duration_s: ``run.max_rl_duration_s``, or 4 x ``duration_s`` when that is None.
    """

    began: float
    duration_s: float
    min_versions: int
    max_duration_s: float
    waited_for_versions: bool = False
    """Set when ``duration_s`` had passed with fewer than ``min_versions`` versions out."""

    @classmethod
    def start(cls, began: float, duration_s: float, min_versions: int, max_duration_s: float | None) -> RlPhaseClock:
        """A clock from the run's settings (``max_duration_s`` None: 4 x ``duration_s``)."""
        return cls(began, duration_s, min_versions, max_duration_s or 4 * duration_s)

    def ended_by(self, now: float, version: int) -> RlEndedBy | None:
        """Why the phase is over at ``now`` with ``version`` the newest published one; None while it goes on."""
        if now - self.began < self.duration_s:
            return None
        if version >= self.min_versions:
            return "versions" if self.waited_for_versions else "duration"
        if now - self.began >= self.max_duration_s:
            return "max_duration"
        self.waited_for_versions = True
        return None
