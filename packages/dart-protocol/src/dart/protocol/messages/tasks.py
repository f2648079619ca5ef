"""Tasks and work items: what to roll out."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from dart.protocol.messages.actions import Action
from dart.protocol.messages.base import (
    MAX_STEPS,
    FiniteFloat,
    Message,
    NonEmptyStr,
    NonNegFloat,
    PolicyVersion,
    Value,
)
from dart.protocol.messages.observation import Sha256Hex
from dart.protocol.messages.sampling import Sampling


class TaskSpec(Value):
    """One task an environment backend can reset to.

    Task suites are files of these; ``params`` is backend-specific and opaque to everything but
    the backend (e.g. the sim family's target button, an OSWorld task's JSON).
    """

    task_id: NonEmptyStr
    """Stable id, unique within a suite (e.g. ``sim/click-button/17``, ``osworld/os/<uuid>``)."""
    backend: NonEmptyStr
    """Env backend that runs it: ``sim``, ``miniwob``, ``desktop``, ``osworld``."""
    instruction: str = Field(default="", max_length=16384)
    """Natural-language goal shown to the policy; backends may fill it at reset."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Backend-specific parameters (JSON values)."""
    max_steps: int = Field(default=15, ge=1, le=1000)
    """Default step budget for this task."""
    tags: tuple[str, ...] = ()
    """Free-form labels (domain, family, difficulty)."""
    requires: tuple[NonEmptyStr, ...] = ()
    """What an env must offer to run the task, as ``<kind>:<name>`` (``app:chrome``, ``metric:compare_table``);
    the data manager keeps only the tasks whose requirements the env pool reports it has
    (:class:`~dart.protocol.messages.EnvCapabilities`). Empty: any env of the backend runs it."""
    reward_range: tuple[FiniteFloat, FiniteFloat] = (0.0, 1.0)
    """Lowest and highest reward the task's evaluator gives. The built-in backends (sim, miniwob,
    desktop, osworld) score in [0, 1] and succeed at the top; dart-data rejects a trajectory whose
    reward falls outside the range, that succeeds with the lowest reward, or fails with the highest."""

    @model_validator(mode="after")
    def _ordered_range(self) -> TaskSpec:
        low, high = self.reward_range
        if not low < high:
            raise ValueError(f"reward_range must be (low, high) with low < high, got {self.reward_range}")
        return self


class PrefixStep(Value):
    """One step of a branch's parent before the branch point: what the runner replays and shows again."""

    response_text: str = Field(default="", max_length=65536)
    """The parent's output at this step (the model sees its earlier outputs as history)."""
    action: Action | None = None
    """The action the step executed; None for an output that did not parse (no env step)."""
    screenshot_sha256: Sha256Hex | None = None
    """Digest of the PNG the step acted on (its observation's screenshot); the fork's replay must show the
    same bytes."""


class BranchSpec(Value):
    """Where a branch work item forks its parent trajectory (see :mod:`dart.data.branching`).

    The runner leases an instance, resets it with the prefix's actions replayed (the env's fork), checks
    each replayed screen against the parent's digests, rebuilds the parent's history at ``step_index``
    (its outputs and screens, so the prompt is the parent's own) and samples from there.
    """

    parent_trajectory_id: NonEmptyStr
    parent_work_id: NonEmptyStr
    step_index: int = Field(ge=1, lt=MAX_STEPS)
    """The parent's step the branch samples again; the parent's steps before it are shared, not repeated."""
    prefix: list[PrefixStep] = Field(max_length=MAX_STEPS)
    """The parent's steps ``0 .. step_index - 1``, in order."""
    screenshot_sha256: Sha256Hex | None = None
    """Digest of the screen at ``step_index`` (what the branch's first step acts on)."""

    @model_validator(mode="after")
    def _whole_prefix(self) -> BranchSpec:
        if len(self.prefix) != self.step_index:
            raise ValueError(f"a branch at step {self.step_index} needs the {self.step_index} steps before it")
        return self

    @property
    def actions(self) -> list[Action]:
        """The prefix's executed actions, in order (what the fork replays)."""
        return [step.action for step in self.prefix if step.action is not None]

    @property
    def screens(self) -> list[str | None]:
        """Digests of the screens the replay passes through: after the reset, then after each executed action."""
        digests = [self.prefix[0].screenshot_sha256]
        for i, step in enumerate(self.prefix):
            if step.action is not None:
                after = self.prefix[i + 1].screenshot_sha256 if i + 1 < len(self.prefix) else self.screenshot_sha256
                digests.append(after)
        return digests


class WorkItem(Message):
    """A request for exactly one trajectory (rollout-wise sampling: no batch barrier).

    Lifecycle: emitted by dart-data onto the work stream -> pulled by one trajectory runner ->
    acked when its trajectory is published (or nak'ed for redelivery if the runner fails).
    """

    kind: Literal["work_item"] = "work_item"
    work_id: NonEmptyStr
    """Unique id; also the JetStream dedupe id, so re-emitting a work item is harmless."""
    task: TaskSpec
    group_id: NonEmptyStr
    """GRPO group this rollout belongs to (same task, same sampling round)."""
    rollout_index: int = Field(ge=0)
    """Index of this rollout within its group, in ``[0, group_size)``."""
    group_size: int = Field(ge=1, le=1024)
    """Number of rollouts in the group."""
    max_steps: int = Field(ge=1, le=1000)
    """Step budget for this trajectory (may differ from the task default: adaptive length)."""
    min_policy_version: PolicyVersion = 0
    """The runner must not sample with an older policy than this."""
    sampling: Sampling = Field(default_factory=Sampling)
    """How the policy samples this trajectory's responses (the data manager's ``emission.sampling``)."""
    created_at: NonNegFloat
    """Unix time, seconds."""
    branch: BranchSpec | None = None
    """Set on a branch of a finished trajectory: fork it at ``branch.step_index`` instead of starting the task
    afresh (same group and rollout index as the parent; ``max_steps`` counts the parent's steps before it)."""

    @model_validator(mode="after")
    def _index_in_group(self) -> WorkItem:
        if self.rollout_index >= self.group_size:
            raise ValueError(f"rollout_index {self.rollout_index} must be < group_size {self.group_size}")
        if self.branch is not None and self.branch.step_index >= self.max_steps:
            raise ValueError(f"a branch at step {self.branch.step_index} leaves no step of max_steps {self.max_steps}")
        return self
