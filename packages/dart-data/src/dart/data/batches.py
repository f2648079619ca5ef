"""From ready GRPO groups to training batches.

Every step of a trajectory carries the trajectory's group-normalized advantage (step-wise GRPO); with branching
rollouts, steps from a branch point on carry the advantage among the siblings there
(:func:`dart.data.advantages.step_advantages`).
A step's images are those its prompt was fed, as the rollout recorded them (``StepRecord.prompt_images``,
references once stored), in prompt order: nothing about the prompt is re-derived here.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from dart.data.advantages import step_advantages
from dart.data.config import BatchingConfig, CurationConfig
from dart.data.groups import ReadyGroup
from dart.protocol.messages import ImageRef, TrainingBatch, TrainingSample, Trajectory


def group_samples(group: ReadyGroup, config: BatchingConfig) -> list[TrainingSample]:
    """Step samples of one group, trajectories in group order, steps in order.

    Steps without prompt or response tokens are skipped (nothing to train on); steps whose output
    did not parse are kept, since their tokens are what the policy produced.
    """
    advantages = step_advantages(
        group.trajectories, pooled=group.pooled, eps=config.advantage_eps, scale_by_std=config.scale_by_std
    )
    samples: list[TrainingSample] = []
    for traj in group.trajectories:
        samples.extend(_trajectory_samples(traj, group, advantages[traj.trajectory_id]))
    return samples


def _trajectory_samples(traj: Trajectory, group: ReadyGroup, advantages: list[float]) -> list[TrainingSample]:
    out = []
    for step, advantage in zip(traj.steps, advantages, strict=True):
        if not step.response_token_ids or not step.prompt_token_ids:
            continue
        images = [image for image in step.prompt_images if isinstance(image, ImageRef)]
        if len(images) != len(step.prompt_images):
            # Ingestion stores every inline image; an inline one here means the trajectory skipped it.
            raise ValueError(f"{traj.trajectory_id} step {step.index}: prompt images must be stored references")
        entropy = sum(step.response_entropy) / len(step.response_entropy) if step.response_entropy else 0.0
        out.append(
            TrainingSample(
                trajectory_id=traj.trajectory_id,
                step_index=step.index,
                group_id=group.group_id,
                task_id=traj.task.task_id,
                advantage=advantage,
                reward=traj.reward,
                policy_version=step.policy_version,
                prompt_token_ids=step.prompt_token_ids,
                response_token_ids=step.response_token_ids,
                rollout_logprobs=step.response_logprobs,
                sampling=step.sampling,
                images=images,
                from_experience_pool=traj.trajectory_id in group.pooled,
                entropy=entropy,
            )
        )
    return out


def batch_id_for(group_ids: list[str]) -> str:
    """A batch id derived from its groups, so re-publishing the same batch deduplicates."""
    return "b-" + hashlib.sha256("\n".join(group_ids).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class FormedBatch:
    """A full batch and the groups it consumed."""

    batch: TrainingBatch
    groups: list[ReadyGroup]


class BatchAssembler:
    """Accumulates groups' samples until a batch is full.

    Batch lifecycle: ``filling`` as groups are added -> ``full`` when it holds ``min_samples``
    samples or ``max_groups`` groups -> high-entropy selection applied -> returned by
    :meth:`add` for publishing -> the next batch starts empty. Groups are never split.

    Args:
        batching: Batch size rules and advantage settings.
        curation: Curation settings.
        max_staleness: ``grouping.max_staleness``, recorded on every batch: the trainer drops samples
            that lag more than this behind its version when the batch is trained.
    """

    def __init__(self, batching: BatchingConfig, curation: CurationConfig, *, max_staleness: int | None) -> None:
        self.batching = batching
        self.curation = curation
        self.max_staleness = max_staleness
        self._samples: list[TrainingSample] = []
        self._groups: list[ReadyGroup] = []

    def add(self, group: ReadyGroup, *, flush_when_full: bool = True) -> tuple[bool, FormedBatch | None]:
        """Add a group's samples.

        Args:
            group: A ready group.
            flush_when_full: False holds the group whatever the batch size (coupled mode: the
                batch is the whole round, formed by :meth:`flush`).

        Returns:
            Whether the group had samples (one without is ignored; the caller records it as
            dropped, reason ``no_samples``), and the batch when it became full.
        """
        samples = group_samples(group, self.batching)
        if samples:
            self._samples.extend(samples)
            self._groups.append(group)
        if not flush_when_full:
            return bool(samples), None
        if len(self._samples) >= self.batching.min_samples or len(self._groups) >= self.batching.max_groups:
            return bool(samples), self.flush()
        return bool(samples), None

    def flush(self) -> FormedBatch | None:
        """The unfinished batch now (None when empty)."""
        if not self._samples:
            return None
        # High-entropy step selection happens in the trainer (exact entropies from its own forward pass).
        samples = self._samples
        versions = [s.policy_version for s in samples]
        batch = TrainingBatch(
            batch_id=batch_id_for([g.group_id for g in self._groups]),
            samples=samples,
            group_ids=[g.group_id for g in self._groups],
            min_policy_version=min(versions),
            max_policy_version=max(versions),
            created_at=time.time(),
            max_staleness=self.max_staleness,
            min_samples=self.batching.min_samples,
        )
        formed = FormedBatch(batch, self._groups)
        self._samples, self._groups = [], []
        return formed
