"""Evaluation on a rollout service's own engines: the request the run's validator sends, and the result.

The rollout service answers an :class:`EvalRequest` by holding one of its engines at the requested
version (loading that version into it when it serves another), running the episodes on it with its
own trajectory runners against the env pool the request names, and releasing the engine to its
regular weight sync. The request names the version by number only: the rollout service reads the
weights' record (URIs and digests) from the trainer's announcement on the ``model`` stream and refuses
a number never announced, so an evaluation cannot make an engine load weights the trainer did not
publish. Training keeps using the other engines; the held one serves training only at the newest
version (held at an older one, it takes no training request until it is back there).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dart.protocol.messages.base import Message, NonEmptyStr, NonNegFloat, PolicyVersion, Value
from dart.protocol.messages.sampling import Sampling
from dart.protocol.messages.tasks import TaskSpec

MAX_EVAL_TASKS = 4096


class EvalRequest(Message):
    """Evaluate one policy version on the rollout service's engines (reply: :class:`EvalResult`)."""

    kind: Literal["eval_request"] = "eval_request"
    label: NonEmptyStr
    """What is evaluated (e.g. ``heldout-v3``); part of the episodes' work ids."""
    version: PolicyVersion = 0
    """The version under test, by number: one the trainer announced on the ``model`` stream (its record
    there says which weights), or 0: the checkpoint the engines started from."""
    tasks: list[TaskSpec] = Field(min_length=1, max_length=MAX_EVAL_TASKS)
    pool: NonEmptyStr
    """Env pool the episodes lease from (the evaluator's own, never a training pool)."""
    episodes_per_task: int = Field(ge=1, le=1024)
    sampling: Sampling
    """How every episode samples (temperature 0: greedy)."""
    concurrency: int = Field(ge=1, le=1024)
    """Episodes in flight."""
    hold_timeout_s: float = Field(default=600.0, gt=0.0)
    """Longest wait for an engine to hold at the version (one may be mid-update), seconds."""


class EvalTaskOutcome(Value):
    """One task's episodes in an :class:`EvalResult`."""

    task_id: NonEmptyStr
    n: int = Field(ge=0)
    """Episodes that ran to an outcome (ok or truncated)."""
    successes: int = Field(ge=0)
    errors: int = Field(ge=0)
    """Episodes lost to the infrastructure."""
    mean_steps: NonNegFloat
    setup_failures: int = Field(default=0, ge=0)
    """Of the errors, episodes whose env could not set the task up (failed before a step)."""


class EvalResult(Message):
    """The outcome of an :class:`EvalRequest`, and which engine served it."""

    kind: Literal["eval_result"] = "eval_result"
    label: NonEmptyStr
    policy_version: PolicyVersion
    """Lowest policy version any counted step was generated with (the held engine's)."""
    sampling: Sampling
    """How the episodes sampled."""
    episodes_per_task: int = Field(ge=1)
    tasks: list[EvalTaskOutcome]
    seconds: NonNegFloat
    statuses: dict[str, int] = Field(default_factory=dict)
    """Trajectories by status value."""
    engine_id: NonEmptyStr
    """The rollout engine that served every episode."""
    engine: NonEmptyStr
    """What that engine is (kind, device or server)."""
