"""Per-task difficulty statistics: what curation decides from.

Only trainable trajectories (ok or truncated) count as attempts: an environment crash says
nothing about how hard a task is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

EMA_ALPHA = 0.1
"""Weight of the newest outcome in the exponential moving average of success."""


@dataclass(frozen=True)
class TaskStats:
    """Outcomes of one task so far (immutable; :meth:`recorded` returns the updated copy).

    Attributes:
        task_id: The task.
        attempts: Trainable trajectories seen.
        successes: Successful ones among them.
        ema_success: Exponential moving average of success (0..1).
        recent: The last ``window`` outcomes, oldest first (1 success, 0 failure).
        success_lengths: Step counts of the last ``window`` successes, oldest first.
    """

    task_id: str
    attempts: int = 0
    successes: int = 0
    ema_success: float = 0.0
    recent: tuple[int, ...] = ()
    success_lengths: tuple[int, ...] = ()

    @property
    def success_rate(self) -> float:
        """Success rate over the recent window (0 when the task was never attempted)."""
        return sum(self.recent) / len(self.recent) if self.recent else 0.0

    def recorded(self, success: bool, num_steps: int, window: int) -> TaskStats:
        """These statistics after one more attempt."""
        ema = float(success) if self.attempts == 0 else (1 - EMA_ALPHA) * self.ema_success + EMA_ALPHA * success
        lengths = (*self.success_lengths, num_steps)[-window:] if success else self.success_lengths
        return replace(
            self,
            attempts=self.attempts + 1,
            successes=self.successes + int(success),
            ema_success=ema,
            recent=(*self.recent, int(success))[-window:],
            success_lengths=lengths,
        )

    def to_row(self) -> dict[str, Any]:
        """Column values of the ``task_stats`` table (without ``updated_at``)."""
        return {
            "task_id": self.task_id,
            "attempts": self.attempts,
            "successes": self.successes,
            "ema_success": self.ema_success,
            "recent_outcomes": json.dumps(list(self.recent)),
            "success_lengths": json.dumps(list(self.success_lengths)),
        }

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TaskStats:
        """Inverse of :meth:`to_row`."""
        return cls(
            task_id=row["task_id"],
            attempts=row["attempts"],
            successes=row["successes"],
            ema_success=row["ema_success"],
            recent=tuple(json.loads(row["recent_outcomes"])),
            success_lengths=tuple(json.loads(row["success_lengths"])),
        )
