"""Branching rollouts: fork a finished episode at its most uncertain steps, and sample again from there.

A group's rollouts all start from the task's first screen, and GRPO gives every step of a trajectory its
reward's advantage: an episode that failed at step 17 teaches its first 16 steps the same negative advantage
as its last. With ``curation.branching`` on, each trainable rollout that arrives is forked at up to
``max_points`` steps where the policy was least sure, ``continuations`` times each. A step's uncertainty is
its mean token entropy, or where the engine records none (vLLM reports top-k log-probs only) its mean
surprisal ``-log p`` of the sampled tokens, whose expectation is the entropy.

A branch is a work item (:class:`~dart.protocol.messages.BranchSpec`) that names its parent and the step, and
carries the parent's steps before it: outputs, actions and screen digests. It is self-contained: the rollout
service needs nothing of the parent's stored blob (which retention may delete), forks the env (a reset that
replays the actions, refused when any screen differs from the parent's) and rebuilds the parent's prompt at
that step from the outputs and the replayed screens. Its advantages come from its siblings
(:func:`dart.data.advantages.step_advantages`).

Lifecycle of a branch: ``planned`` when its parent is first ingested, before the parent joins its group (so
the group counts it among the members it waits for) -> ``emitted`` with the parent's group id and rollout
index, outside the decoupled emitter's ``max_outstanding`` gate (its group was admitted already) but in its
outstanding account -> answered by a forked trajectory (``Trajectory.branch``), or by a normal rollout when the
env refused the fork (``Trajectory.branch_refused``: counted, and it joins the group as one more rollout) ->
grouped. Only rollouts are branched, not branches (depth one), and only where the env pool reports ``fork``
(:attr:`Brancher.forks`: the local desktop and OSWorld do not).
"""

from __future__ import annotations

import hashlib
import time

from dart.data.config import BranchingConfig
from dart.protocol.messages import (
    BranchSpec,
    Image,
    InlineImage,
    PrefixStep,
    Sampling,
    StepRecord,
    Trajectory,
    WorkItem,
)


def uncertainty(step: StepRecord) -> float | None:
    """How unsure the policy was at a step: its mean token entropy, else its mean surprisal (nats); None for a
    step without response tokens."""
    if step.response_entropy:
        return sum(step.response_entropy) / len(step.response_entropy)
    if step.response_logprobs:
        return -sum(step.response_logprobs) / len(step.response_logprobs)
    return None


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def branch_points(traj: Trajectory, config: BranchingConfig) -> list[int]:
    """The steps to branch a trajectory at, in step order: the ``max_points`` most uncertain from ``min_step``
    on (ties to the earlier step), those below the ``min_quantile`` of all its steps' uncertainty left out."""
    scored = [(u, step.index) for step in traj.steps if (u := uncertainty(step)) is not None]
    if config.min_quantile is not None and scored:
        floor = _quantile([u for u, _ in scored], config.min_quantile)
        scored = [(u, i) for u, i in scored if u >= floor]
    candidates = [(u, i) for u, i in scored if i >= config.min_step]
    chosen = sorted(candidates, key=lambda ui: (-ui[0], ui[1]))[: config.max_points]
    return sorted(i for _, i in chosen)


def _digest(image: Image | None) -> str | None:
    if image is None:
        return None
    return hashlib.sha256(image.png).hexdigest() if isinstance(image, InlineImage) else image.sha256


def branch_spec(traj: Trajectory, step_index: int) -> BranchSpec:
    """What a branch of ``traj`` at ``step_index`` needs: the steps before it and the screen at it.

    Raises:
        ValueError: ``step_index`` is not one of the trajectory's steps after its first.
    """
    if traj.first_step != 0 or not 1 <= step_index < len(traj.steps):
        raise ValueError(f"{traj.trajectory_id} has no step {step_index} to branch at (it has {len(traj.steps)})")
    prefix = [
        PrefixStep(
            response_text=step.response_text,
            action=step.action,
            screenshot_sha256=_digest(step.observation.screenshot),
        )
        for step in traj.steps[:step_index]
    ]
    return BranchSpec(
        parent_trajectory_id=traj.trajectory_id,
        parent_work_id=traj.work_id,
        step_index=step_index,
        prefix=prefix,
        screenshot_sha256=_digest(traj.steps[step_index].observation.screenshot),
    )


class Brancher:
    """Plans the branches of arriving rollouts.

    Example::

        brancher = Brancher(config.curation.branching)
        brancher.forks = "fork" in capabilities.features      # from the env pool
        items = brancher.plan(trajectory, max_steps=15, min_policy_version=3, sampling=Sampling())

    Attributes:
        config: The branching settings.
        forks: Whether the env pool forks: None until it said, and no branch is planned before.
    """

    def __init__(self, config: BranchingConfig) -> None:
        self.config = config
        self.forks: bool | None = None

    def wants(self, traj: Trajectory) -> bool:
        """Whether ``traj`` is a rollout to branch: trainable, not itself a branch (or a refused one), with a
        step after ``min_step``, on a pool that forks."""
        return (
            self.config.enabled
            and bool(self.forks)
            and traj.trainable
            and traj.branch is None
            and traj.branch_refused is None
            and len(traj.steps) > self.config.min_step
        )

    def plan(self, traj: Trajectory, *, max_steps: int, min_policy_version: int, sampling: Sampling) -> list[WorkItem]:
        """The branch work items of one rollout (none when :meth:`wants` says no).

        Work ids derive from the parent's (``<work_id>-b<step>-<k>``), so planning the same parent again
        emits the same items, which the work stream deduplicates.

        Args:
            traj: The stored rollout (screenshots by reference).
            max_steps: The task's step budget now; a branch gets at least one step past its point.
            min_policy_version: The oldest policy the branches may be sampled with.
            sampling: How the branches sample (the emission's).
        """
        if not self.wants(traj):
            return []
        now = time.time()
        items: list[WorkItem] = []
        for point in branch_points(traj, self.config):
            spec = branch_spec(traj, point)
            items += [
                WorkItem(
                    work_id=f"{traj.work_id}-b{point}-{k}",
                    task=traj.task,
                    group_id=traj.group_id,
                    rollout_index=traj.rollout_index,
                    group_size=traj.group_size,
                    max_steps=max(max_steps, point + 1),
                    min_policy_version=min_policy_version,
                    sampling=sampling,
                    created_at=now,
                    branch=spec,
                )
                for k in range(self.config.continuations)
            ]
        return items
