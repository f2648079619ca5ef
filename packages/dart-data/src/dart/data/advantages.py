"""Group-relative advantages (GRPO): dart-data computes them when it forms batches; the trainer only reads them.

Each trajectory's advantage is its reward normalized within its group:
``(r - mean(r)) / (std(r) + eps)``; step-wise GRPO gives every step its trajectory's advantage.

With branching rollouts (:mod:`dart.data.branching`) a group also holds branches: continuations forked from a
rollout's step. Their steps, and the parent's from that step on, are credited against the siblings at that
point instead (:func:`step_advantages`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Sequence

from dart.protocol.messages import Trajectory


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


def _against(reward: float, rewards: Sequence[float], *, eps: float, scale_by_std: bool) -> float:
    """``reward`` normalized by the statistics of ``rewards`` (a member's advantage in a group it is not in)."""
    mean = sum(rewards) / len(rewards)
    if not scale_by_std:
        return reward - mean
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return (reward - mean) / (std + eps)


def step_advantages(
    members: Sequence[Trajectory],
    *,
    pooled: Collection[str] = (),
    eps: float = 1e-6,
    scale_by_std: bool = True,
) -> dict[str, list[float]]:
    """The advantage of every recorded step of a group's members, by trajectory id, in step order.

    - A rollout (a member that is not a branch; experience-pool members count as rollouts) gets the group's
      advantage over the rollouts (:func:`group_advantages`) on its steps before its first branch point.
    - At a branch point ``k`` of a rollout, the siblings are the rollout and the branches forked there. From
      ``k`` on (up to its next branch point) the rollout's steps get its advantage among those siblings, and
      each branch's steps (all from ``k``) get theirs.
    - Siblings fewer than two (the branches forked there did not arrive, or arrived unusable) compare nothing:
      their steps keep the group's baseline (a lone branch: its reward against the rollouts' statistics).

    Without branches this is :func:`group_advantages`, step-wise.

    Raises:
        ValueError: No members, or a non-finite reward.
    """
    if not members:
        raise ValueError("a group needs at least one member")
    is_branch = {t.trajectory_id: t.branch is not None and t.trajectory_id not in pooled for t in members}
    rollouts = [t for t in members if not is_branch[t.trajectory_id]] or list(members)
    rollout_rewards = [t.reward for t in rollouts]
    baseline = dict(
        zip(
            (t.trajectory_id for t in rollouts),
            group_advantages(rollout_rewards, eps=eps, scale_by_std=scale_by_std),
            strict=True,
        )
    )
    forked: dict[tuple[str, int], list[Trajectory]] = defaultdict(list)
    for t in members:
        if is_branch[t.trajectory_id] and t.branch is not None:
            forked[(t.branch.parent_trajectory_id, t.branch.step_index)].append(t)
    by_id = {t.trajectory_id: t for t in members}
    at_point: dict[tuple[str, int], dict[str, float]] = {}
    for (parent_id, point), branches in forked.items():
        parent = by_id.get(parent_id)
        siblings = ([parent] if parent is not None and not is_branch[parent_id] else []) + branches
        if len(siblings) >= 2:
            values = group_advantages([t.reward for t in siblings], eps=eps, scale_by_std=scale_by_std)
            at_point[(parent_id, point)] = dict(zip((t.trajectory_id for t in siblings), values, strict=True))
    out: dict[str, list[float]] = {}
    for t in members:
        tid = t.trajectory_id
        if is_branch[tid] and t.branch is not None:
            siblings_adv = at_point.get((t.branch.parent_trajectory_id, t.branch.step_index))
            value = (
                siblings_adv[tid]
                if siblings_adv is not None
                else _against(t.reward, rollout_rewards, eps=eps, scale_by_std=scale_by_std)
            )
            out[tid] = [value] * len(t.steps)
            continue
        points = sorted(point for parent_id, point in at_point if parent_id == tid)
        values = []
        for step in t.steps:
            deepest = max((k for k in points if k <= step.index), default=None)
            values.append(baseline[tid] if deepest is None else at_point[(tid, deepest)][tid])
        out[tid] = values
    return out
