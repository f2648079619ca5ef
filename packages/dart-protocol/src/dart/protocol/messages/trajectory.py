"""Steps and trajectories: what a policy produced in an environment.

Trajectory lifecycle: created by a runner when it takes a work item -> steps appended as the
agent acts -> closed with a status and (if evaluated) a reward -> published durably to the
trajectory stream -> stored once by dart-data (idempotent by ``trajectory_id``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field, model_validator

from dart.protocol.messages.actions import Action
from dart.protocol.messages.base import (
    MAX_PROMPT_TOKENS,
    MAX_RESPONSE_TOKENS,
    MAX_STEPS,
    FiniteFloat,
    Message,
    NonEmptyStr,
    NonNegFloat,
    PolicyVersion,
    TokenId,
    Value,
)
from dart.protocol.messages.observation import Image, Observation
from dart.protocol.messages.sampling import SamplingParams
from dart.protocol.messages.tasks import TaskSpec


class TrajectoryStatus(StrEnum):
    """How a trajectory ended. These are different outcomes, not shades of one."""

    OK = "ok"
    """The agent ended the episode (finished/fail) and it was evaluated."""
    TRUNCATED = "truncated"
    """Hit max_steps; evaluated as-is."""
    ABORTED = "aborted"
    """Stopped from outside (shutdown, staleness, cancellation); not evaluated, not for training."""
    ENV_FAILED = "env_failed"
    """The environment crashed or stopped responding; not for training."""
    FAILED = "failed"
    """The runner or engine failed; not for training."""


TRAINABLE_STATUSES = frozenset({TrajectoryStatus.OK, TrajectoryStatus.TRUNCATED})
"""Statuses whose trajectories carry a meaningful reward."""


class StepTimings(Value):
    """Where a step's wall time went, seconds."""

    generate_s: NonNegFloat = 0.0
    """Waiting for and running the engine."""
    env_s: NonNegFloat = 0.0
    """Round trip of the env step request."""
    total_s: NonNegFloat = 0.0


class StepRecord(Value):
    """One agent step: what the policy saw, what it produced, and what it did.

    The step is the single record of the policy's inputs: ``prompt_token_ids`` and ``prompt_images``
    are everything the trainer needs to rebuild the exact forward pass of the rollout engine.

    Token arrays are aligned: ``response_logprobs[i]`` (and ``response_entropy[i]`` when recorded)
    belong to ``response_token_ids[i]``. ``prompt_token_ids`` is the exact tokenization the engine
    used, so the trainer recomputes log-probs on the same tokens.
    """

    index: int = Field(ge=0)
    policy_version: PolicyVersion
    """Version of the weights that generated this step."""
    observation: Observation
    """The observation the policy acted on (its screenshot is the newest image of the prompt)."""
    prompt_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_PROMPT_TOKENS)
    prompt_images: list[Image] = Field(default_factory=list, max_length=64)
    """The images the policy consumed, in prompt order (one per image placeholder of
    ``prompt_token_ids``). Each is a PNG whose RGB decode is exactly the pixel array the processor was
    given: the rollout records the image as fed (already resized, when it resizes), so rebuilding the
    model inputs needs no rule or setting of the rollout. Small ones travel inline; dart-data stores
    every inline image at ingestion and keeps a reference (sha256-named), so a stored trajectory
    holds references only. Empty when the prompt had no images."""
    response_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_RESPONSE_TOKENS)
    response_logprobs: list[FiniteFloat] = Field(default_factory=list, max_length=MAX_RESPONSE_TOKENS)
    """Behaviour log-probability of each response token: under the distribution it was sampled from,
    as ``sampling`` describes it (natural log)."""
    response_entropy: list[NonNegFloat] = Field(default_factory=list, max_length=MAX_RESPONSE_TOKENS)
    """Entropy of the raw (temperature 1) next-token distribution at each response token, nats; empty
    when the engine does not report it (vLLM gives top-k log-probs only; the trainer computes exact
    entropies from full logits)."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """The behaviour distribution ``response_logprobs`` belong to."""
    response_text: str = ""
    """Decoded model output (``Thought: ... Action: ...``)."""
    action: Action | None = None
    """Parsed action, or None when the output did not parse."""
    parse_error: str | None = None
    """Why the output did not parse into an action."""
    timings: StepTimings = Field(default_factory=StepTimings)

    @model_validator(mode="after")
    def _aligned(self) -> StepRecord:
        n = len(self.response_token_ids)
        if len(self.response_logprobs) != n or len(self.response_entropy) not in (0, n):
            raise ValueError(
                f"response arrays differ in length: {n} tokens, {len(self.response_logprobs)} logprobs, "
                f"{len(self.response_entropy)} entropies"
            )
        if (self.action is None) == (self.parse_error is None):
            raise ValueError("a step has either an action or a parse_error, exactly one of them")
        return self


class BranchOrigin(Value):
    """Where a branch trajectory forked its parent: its steps start at ``step_index``, after the parent's."""

    parent_trajectory_id: NonEmptyStr
    step_index: int = Field(ge=1, lt=MAX_STEPS)


class Trajectory(Message):
    """One episode: the unit of rollout-wise sampling."""

    kind: Literal["trajectory"] = "trajectory"
    trajectory_id: NonEmptyStr
    work_id: NonEmptyStr
    task: TaskSpec
    group_id: NonEmptyStr
    rollout_index: int = Field(ge=0)
    group_size: int = Field(ge=1)
    steps: list[StepRecord] = Field(default_factory=list, max_length=MAX_STEPS)
    status: TrajectoryStatus
    reward: FiniteFloat = 0.0
    success: bool = False
    min_policy_version: PolicyVersion
    """Oldest policy version among the steps (the start version when there are no steps)."""
    max_policy_version: PolicyVersion
    """Newest policy version among the steps."""
    env_instance_id: str | None = None
    runner_id: str | None = None
    started_at: NonNegFloat
    """Unix time, seconds."""
    finished_at: NonNegFloat
    error: str | None = None
    """What went wrong, for non-ok statuses."""
    branch: BranchOrigin | None = None
    """Set on a branch (a work item with ``branch``, forked): its steps are numbered from ``branch.step_index``
    and follow the parent's steps before it, which are not repeated here."""
    branch_refused: str | None = Field(default=None, max_length=64)
    """Why a branch work item was answered as a normal rollout from the task's start instead (``fork_mismatch``:
    the replay did not show the parent's screens; ``fork_unsupported``; ``fork_ended``: the replay ended the
    episode early)."""

    @model_validator(mode="after")
    def _consistent(self) -> Trajectory:
        if self.finished_at < self.started_at:
            raise ValueError("finished_at is before started_at")
        if self.min_policy_version > self.max_policy_version:
            raise ValueError("min_policy_version > max_policy_version")
        if self.steps:
            versions = [s.policy_version for s in self.steps]
            if min(versions) != self.min_policy_version or max(versions) != self.max_policy_version:
                raise ValueError(
                    f"policy version range {self.min_policy_version}..{self.max_policy_version} does not match "
                    f"the steps' {min(versions)}..{max(versions)}"
                )
            first = self.branch.step_index if self.branch is not None else 0
            if [s.index for s in self.steps] != list(range(first, first + len(self.steps))):
                raise ValueError(f"step indices must be {first}..{first}+n-1 in order")
        if self.branch is not None and self.branch_refused is not None:
            raise ValueError("a trajectory is either a branch or a refused branch, not both")
        return self

    @property
    def first_step(self) -> int:
        """Index of the first step recorded here (a branch's branch point, else 0)."""
        return self.branch.step_index if self.branch is not None else 0

    @property
    def trainable(self) -> bool:
        """Whether the trajectory's reward can be used for training."""
        return self.status in TRAINABLE_STATUSES
