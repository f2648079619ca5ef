"""Env service requests and replies (core NATS request/reply).

Lease lifecycle: ``free -> leased`` on :class:`LeaseRequest` (the reply names the instance and
lease id) ``-> leased`` while the holder heartbeats before ``expires_at`` ``-> free`` on
:class:`ReleaseRequest`, on expiry (holder stopped heartbeating), or ``-> failed`` when the
instance crashes (requests on it are answered with ``env_failed``; the pool replaces it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dart.protocol.messages.actions import Action
from dart.protocol.messages.base import MAX_STEPS, FiniteFloat, Message, NonEmptyStr, NonNegFloat
from dart.protocol.messages.observation import MetadataValue, Observation, Sha256Hex
from dart.protocol.messages.tasks import TaskSpec


class LeaseRequest(Message):
    """Ask a pool for an env instance."""

    kind: Literal["env.lease"] = "env.lease"
    holder: NonEmptyStr
    """Who holds the lease (runner id), for diagnostics and stale-lease cleanup."""
    ttl_s: NonNegFloat = Field(default=60.0, gt=0.0, le=3600.0)
    """Lease lifetime without a heartbeat, seconds."""
    task_id: str | None = None
    """Optional task hint, so a pool may prefer an instance already set up for it."""


class LeaseReply(Message):
    """A granted lease."""

    kind: Literal["env.lease.reply"] = "env.lease.reply"
    lease_id: NonEmptyStr
    instance_id: NonEmptyStr
    """Instance to address with :meth:`Subjects.env_instance`."""
    backend: NonEmptyStr
    expires_at: NonNegFloat
    """Unix time, seconds, after which the lease is void without a heartbeat."""
    heartbeat_interval_s: NonNegFloat = Field(gt=0.0)
    """How often the holder should heartbeat."""
    screen_width: int = Field(ge=1)
    screen_height: int = Field(ge=1)


class HeartbeatRequest(Message):
    """Extend a lease."""

    kind: Literal["env.heartbeat"] = "env.heartbeat"
    lease_id: NonEmptyStr


class HeartbeatReply(Message):
    """The lease's new expiry, and how far the service has got with the holder's calls."""

    kind: Literal["env.heartbeat.reply"] = "env.heartbeat.reply"
    expires_at: NonNegFloat
    calls_received: int | None = Field(default=None, ge=0)
    """Reset, step and evaluate requests on this lease that reached the service (answered, running or
    queued). Below what the holder sent, a request of its was lost on the way (a broker node died under
    it); None from a service that does not count."""
    calls_answered: int | None = Field(default=None, ge=0)
    """Of those, how many the service has answered. Up to what the holder sent while it still waits,
    the reply was lost on the way back."""


class ResetRequest(Message):
    """Reset the leased instance to a task; with ``replay``, fork an episode of it.

    A fork resets and replays the actions, so the instance ends in the state they led to (a pool whose backend
    cannot do that exactly does not report ``fork`` among its features and refuses). Where ``expect_sha256``
    names a digest, the screen at that point must have exactly those PNG bytes, or the fork is refused
    (``conflict`` with ``details.reason`` ``fork_mismatch``; ``fork_unsupported`` and ``fork_ended`` likewise),
    and the lease stays its holder's for a plain reset.
    """

    kind: Literal["env.reset"] = "env.reset"
    lease_id: NonEmptyStr
    task: TaskSpec
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    replay: list[Action] = Field(default_factory=list, max_length=MAX_STEPS)
    """Actions to execute after the reset, in order (a fork); none for a plain reset."""
    expect_sha256: list[Sha256Hex | None] = Field(default_factory=list, max_length=MAX_STEPS + 1)
    """Digests of the screens the fork must pass through: after the reset, then after each replayed action
    (``len(replay) + 1`` entries; None skips one), or empty to check none."""

    @model_validator(mode="after")
    def _one_digest_per_screen(self) -> ResetRequest:
        if self.expect_sha256 and len(self.expect_sha256) != len(self.replay) + 1:
            raise ValueError(
                f"expect_sha256 needs one digest per screen of the fork ({len(self.replay) + 1}: after the reset and "
                f"after each replayed action), got {len(self.expect_sha256)}"
            )
        return self


class ResetReply(Message):
    """The first observation of an episode."""

    kind: Literal["env.reset.reply"] = "env.reset.reply"
    observation: Observation
    instruction: str
    """The task's instruction as the backend resolved it."""
    env_latency_s: NonNegFloat
    """Time the backend spent resetting, seconds."""
    replayed: list[Observation] = Field(default_factory=list, max_length=MAX_STEPS)
    """For a fork: the observation after each replayed action, in order (``observation`` is the one after the
    reset); the last is the forked state."""


class StepRequest(Message):
    """Execute one action on the leased instance."""

    kind: Literal["env.step"] = "env.step"
    lease_id: NonEmptyStr
    action: Action
    step_index: int = Field(ge=0)
    """Index of this step in the episode, to detect duplicated or lost requests."""


class StepReply(Message):
    """The observation after an action."""

    kind: Literal["env.step.reply"] = "env.step.reply"
    observation: Observation
    done: bool
    """Whether the episode ended (terminal action or env-side end)."""
    env_latency_s: NonNegFloat
    """Time the backend spent executing the action and capturing the screen, seconds."""
    info: dict[str, MetadataValue] = Field(default_factory=dict)


class EvaluateRequest(Message):
    """Score the episode on the leased instance."""

    kind: Literal["env.evaluate"] = "env.evaluate"
    lease_id: NonEmptyStr


class EvaluateReply(Message):
    """The episode's reward."""

    kind: Literal["env.evaluate.reply"] = "env.evaluate.reply"
    reward: FiniteFloat
    success: bool
    env_latency_s: NonNegFloat
    details: dict[str, MetadataValue] = Field(default_factory=dict)


class ReleaseRequest(Message):
    """Give the instance back to its pool."""

    kind: Literal["env.release"] = "env.release"
    lease_id: NonEmptyStr
    reason: str = ""


class ReleaseReply(Message):
    """Whether the lease was still held when released (False: it had expired already)."""

    kind: Literal["env.release.reply"] = "env.release.reply"
    released: bool


class CapabilitiesRequest(Message):
    """Ask an env pool what it can run (answered by any one of the pool's env services)."""

    kind: Literal["env.capabilities"] = "env.capabilities"


class EnvCapabilities(Message):
    """What an env pool runs: its backend and the task requirements it meets (:attr:`TaskSpec.requires`)."""

    kind: Literal["env.capabilities.reply"] = "env.capabilities.reply"
    pool: NonEmptyStr
    backend: NonEmptyStr
    """The backend the pool hosts (``sim``, ``miniwob``, ``osworld``)."""
    provider: str | None = None
    """Where the backend's machines come from (osworld: ``local``, ``docker``, ``remote``); None where it
    does not apply."""
    features: tuple[NonEmptyStr, ...] = ()
    """The requirements the pool meets (``app:chrome``, ``step:execute``, ``metric:exact_match``)."""
