"""Group-relative advantages (GRPO).

Each trajectory's advantage is its reward normalized within its group (same task, same sampling
round): ``(r - mean(r)) / (std(r) + eps)``. Step-wise GRPO then gives every step of a trajectory
that trajectory's advantage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], *, eps: float = 1e-6, scale_by_std: bool = True) -> list[float]:
    """Group-normalized advantages of one group's rewards.

    Args:
        rewards: One reward per trajectory of the group.
        eps: Added to the standard deviation to avoid dividing by zero.
        scale_by_std: Divide by the group's standard deviation (GRPO); False keeps only the mean
            baseline (Dr. GRPO style).

    Returns:
        One advantage per reward, in the same order. A group with no reward variance has all
        advantages zero (it carries no learning signal; the data manager drops such groups).

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
    # Population std, as in GRPO: the group is the whole sample of this task's rollouts.
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]


def has_variance(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """Whether a group's rewards differ (otherwise every advantage is zero)."""
    return bool(rewards) and max(rewards) - min(rewards) > tol
