"""Group-relative advantages (GRPO): dart-data computes them when it forms batches; the trainer only reads them.

Each trajectory's advantage is its reward normalized within its group:
``(r - mean(r)) / (std(r) + eps)``; step-wise GRPO gives every step its trajectory's advantage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], *, eps: float = 1e-6, scale_by_std: bool = True) -> list[float]:
    """Group-normalized advantages of one group's rewards, in the same order.

    Args:
        rewards: One reward per trajectory of the group.
        eps: Added to the standard deviation to avoid dividing by zero.
        scale_by_std: Divide by the population std (GRPO); False keeps only the mean baseline.

    Raises:
        ValueError: Empty group or a non-finite reward.
    """
    if not rewards:
        raise ValueError("a group needs at least one reward")
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not scale_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]


def has_variance(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """Whether a group's rewards differ (otherwise every advantage is zero)."""
    return bool(rewards) and max(rewards) - min(rewards) > tol
