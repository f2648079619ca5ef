"""Training batches and model versions."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dart.protocol.messages.base import (
    MAX_BATCH_GROUPS,
    MAX_BATCH_SAMPLES,
    MAX_PROMPT_TOKENS,
    MAX_RESPONSE_TOKENS,
    FiniteFloat,
    Message,
    NonEmptyStr,
    NonNegFloat,
    PolicyVersion,
    TokenId,
    Value,
)
from dart.protocol.messages.observation import ImageRef, Sha256Hex
from dart.protocol.messages.sampling import SamplingParams


class TrainingSample(Value):
    """One step of one trajectory, carrying its trajectory's group-normalized advantage.

    The prompt's images are by reference; tokens are exactly the rollout's, so the trainer's
    recomputed log-probs and the rollout log-probs refer to the same tokens.
    """

    trajectory_id: NonEmptyStr
    step_index: int = Field(ge=0)
    group_id: NonEmptyStr
    task_id: NonEmptyStr
    advantage: FiniteFloat
    """Group-normalized advantage of the trajectory (GRPO)."""
    reward: FiniteFloat
    policy_version: PolicyVersion
    """Version that generated the step (behaviour policy)."""
    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    response_token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_RESPONSE_TOKENS)
    rollout_logprobs: list[FiniteFloat] = Field(max_length=MAX_RESPONSE_TOKENS)
    """Behaviour-policy log-probs of the response tokens, aligned with ``response_token_ids``, under the
    distribution ``sampling`` describes."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """How the response was sampled (the trainer recomputes log-probs of the same distribution)."""
    images: list[ImageRef] = Field(default_factory=list, max_length=64)
    """Screenshots in the prompt, oldest first."""
    from_experience_pool: bool = False
    """Whether the trajectory came from the experience pool rather than the current round."""
    entropy: NonNegFloat = 0.0
    """Mean response-token entropy of the step (used for high-entropy selection)."""

    @model_validator(mode="after")
    def _aligned(self) -> TrainingSample:
        if len(self.rollout_logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"{len(self.rollout_logprobs)} rollout logprobs for {len(self.response_token_ids)} response tokens"
            )
        return self


class TrainingBatch(Message):
    """A batch of step samples from complete GRPO groups, served by dart-data to dart-train."""

    kind: Literal["training_batch"] = "training_batch"
    batch_id: NonEmptyStr
    samples: list[TrainingSample] = Field(min_length=1, max_length=MAX_BATCH_SAMPLES)
    group_ids: list[NonEmptyStr] = Field(min_length=1, max_length=MAX_BATCH_GROUPS)
    min_policy_version: PolicyVersion
    max_policy_version: PolicyVersion
    created_at: NonNegFloat
    """Unix time, seconds."""
    max_staleness: int | None = Field(default=None, ge=0)
    """The staleness bound the batch was formed under (the data manager's ``grouping.max_staleness``):
    the trainer drops samples more than this many versions behind its own at training time
    (experience-pool replays excepted); None: no bound."""
    min_samples: int | None = Field(default=None, ge=1)
    """The batch size it was formed for (the data manager's ``batching.min_samples``): when the trainer drops
    unusable samples (a screenshot missing or corrupt, tokens that disagree with the images), the rest
    trains only while at least ``min(min_samples, len(samples))`` remain; None: while any remains."""

    @model_validator(mode="after")
    def _consistent(self) -> TrainingBatch:
        versions = [s.policy_version for s in self.samples]
        if min(versions) != self.min_policy_version or max(versions) != self.max_policy_version:
            raise ValueError("batch policy version range does not match its samples")
        missing = {s.group_id for s in self.samples} - set(self.group_ids)
        if missing:
            raise ValueError(f"samples reference groups not listed in group_ids: {sorted(missing)[:3]}")
        return self


class ModelVersion(Message):
    """Announcement of new policy weights (published by dart-train, consumed by engines).

    Lifecycle of an engine update it triggers: ``serving -> draining`` (finish or pause in-flight
    requests) ``-> loading`` (fetch ``uri``, verify ``sha256``) ``-> serving`` at ``version``.
    """

    kind: Literal["model_version"] = "model_version"
    version: PolicyVersion
    uri: NonEmptyStr
    """Artifact URI of the safetensors weights: the file of a one-shard version, the index
    (``model.safetensors.index.json``) of a sharded one."""
    sha256: Sha256Hex
    """Digest of the file at ``uri``."""
    manifest_uri: str | None = None
    """Artifact URI of the manifest (every shard's uri and sha256, base model, trainer step)."""
    manifest_sha256: Sha256Hex | None = None
    """Digest of the manifest's bytes, set with ``manifest_uri``: a fetch checks it before it reads a
    shard's name or digest from the manifest (whoever can write the store cannot swap it)."""
    shards: int = Field(default=1, ge=1)
    """Safetensors files the version is split into; above 1 the fetch reads their digests from the manifest."""
    size_bytes: int = Field(default=0, ge=0)
    trainer_step: int = Field(default=0, ge=0)
    base_model: str = ""
    """Name or path of the architecture/base checkpoint the weights belong to."""
    created_at: NonNegFloat
    """Unix time, seconds."""

    @model_validator(mode="after")
    def _sharded_has_manifest(self) -> ModelVersion:
        if self.shards > 1 and not self.manifest_uri:
            raise ValueError(f"shards is {self.shards}: a sharded version needs manifest_uri (it lists the shards)")
        if self.manifest_uri and self.manifest_sha256 is None:
            raise ValueError("manifest_uri needs manifest_sha256: a manifest is trusted only by its digest")
        return self
