"""What a trajectory must mean to be admitted: the ingestion checks.

A trajectory that decodes is well-formed: the wire schema checks types, finite floats and aligned
token/log-prob arrays, and a message that fails it is terminated by the consumer and recorded here
under a reason (:func:`undecodable_reason`). What decodes can still be meaningless; the checks below
catch that before anything is stored, so a rejected trajectory never reaches the index, the task
statistics, the experience pool, a group or a batch. Each rejection has one reason:

``unknown_work``
    Its work item was never emitted by this data manager (another run's, or made up). Only checked
    when this data manager emits the run's work; the emitted work items are in the index, so the
    check holds across restarts.
``work_mismatch``
    Its group, task or rollout index differ from those of the work item it names; or its branch (parent and
    step) does, or it answers a branch work item as a rollout without saying why (``branch_refused``).
``duplicate_work``
    Another trajectory (a different id) already answered the same work item. The same id again is a
    redelivery, not a rejection.
``reward_out_of_range``
    The reward is outside the task's declared ``reward_range``.
``success_contradicts``
    ``success`` disagrees with the status (only an evaluated trajectory, ok or truncated, can
    succeed) or with the reward (a success never earns the lowest reward, a failure never the highest).
``logprob_positive``
    A behaviour log-probability above 0 (a probability above 1).
``foreign_image``
    A step's screenshot or prompt image refers to a URI outside the run's store (another bucket,
    ``file:///etc/...``): nothing outside the store is read on a message's word.
``missing_image``
    A step's screenshot or prompt image refers to an object that is not in the store.
``logprob_not_finite``, ``misaligned_arrays``, ``undecodable``
    The message failed the wire schema (see :func:`undecodable_reason`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dart.protocol.errors import MessageValidationError
from dart.protocol.messages import ImageRef, TaskSpec, Trajectory

LOGPROB_TOLERANCE = 1e-5
"""How far above 0 a log-prob may be: a renormalized (tempered, nucleus) distribution's log-softmax can
round a little above 0 for a token of probability ~1."""


@dataclass(frozen=True)
class Rejection:
    """Why a delivered trajectory was refused.

    Attributes:
        reason: One of the reasons in the module docstring.
        detail: What exactly was wrong (field and value), for the log and the rejected table.
    """

    reason: str
    detail: str


def check_trajectory(
    traj: Trajectory,
    *,
    work: Mapping[str, Any] | None,
    require_work: bool,
    task: TaskSpec | None,
    answered_by: Sequence[str],
    image_exists: Callable[[ImageRef], bool],
    image_is_ours: Callable[[ImageRef], bool] = lambda _: True,
) -> Rejection | None:
    """The first reason to refuse ``traj``, or None when it may be stored.

    Args:
        traj: The delivered trajectory (not yet stored).
        work: The index row of the work item it names, None when this data manager never emitted it.
        require_work: Whether the work item must be one this data manager emitted.
        task: The run's own spec of the trajectory's task (its declared reward range); None uses the
            trajectory's copy.
        answered_by: Ids of stored trajectories that answered the same work item.
        image_exists: Whether an image reference names an object in the store.
        image_is_ours: Whether an image reference lies in the run's store (checked first).
    """
    if require_work:
        if work is None:
            return Rejection("unknown_work", f"work item {traj.work_id!r} was not emitted by this run")
        named = (traj.group_id, traj.task.task_id, traj.rollout_index)
        emitted = (work["group_id"], work["task_id"], work["rollout_index"])
        if named != emitted:
            return Rejection(
                "work_mismatch",
                f"(group_id, task_id, rollout_index) {named} differ from work item {traj.work_id!r}'s {emitted}",
            )
        branch = (traj.branch.parent_trajectory_id, traj.branch.step_index) if traj.branch is not None else None
        asked = (work.get("parent_trajectory_id"), work.get("branch_step"))
        if branch is not None and branch != asked:
            return Rejection("work_mismatch", f"branch {branch} differs from work item {traj.work_id!r}'s {asked}")
        if asked[0] is not None and branch is None and traj.branch_refused is None:
            return Rejection("work_mismatch", f"work item {traj.work_id!r} asked for a branch of {asked[0]!r}")
    others = [tid for tid in answered_by if tid != traj.trajectory_id]
    if others:
        return Rejection("duplicate_work", f"work item {traj.work_id!r} was already answered by {others[0]!r}")
    low, high = (task or traj.task).reward_range
    if not low <= traj.reward <= high:
        return Rejection("reward_out_of_range", f"reward {traj.reward} outside the task's reward_range [{low}, {high}]")
    if traj.success and not traj.trainable:
        return Rejection("success_contradicts", f"success with status {traj.status.value!r} (not evaluated)")
    if traj.success and traj.reward <= low:
        return Rejection("success_contradicts", f"success with the lowest reward {traj.reward}")
    if not traj.success and traj.trainable and traj.reward >= high:
        return Rejection("success_contradicts", f"failure with the highest reward {traj.reward}")
    for step in traj.steps:
        worst = max(step.response_logprobs, default=0.0)
        if worst > LOGPROB_TOLERANCE:
            return Rejection("logprob_positive", f"steps[{step.index}].response_logprobs holds {worst} > 0")
    checked: set[str] = set()
    for step in traj.steps:
        for image in (step.observation.screenshot, *step.prompt_images):
            if isinstance(image, ImageRef) and image.uri not in checked:
                checked.add(image.uri)
                if not image_is_ours(image):
                    return Rejection("foreign_image", f"steps[{step.index}] refers to {image.uri}, outside the store")
                if not image_exists(image):
                    return Rejection("missing_image", f"steps[{step.index}] refers to {image.uri}, not in the store")
    return None


def undecodable_reason(error: MessageValidationError) -> Rejection:
    """The rejection of a message that failed the wire schema, named by what failed."""
    for e in error.errors:
        loc, msg = str(e.get("loc", "")), str(e.get("msg", ""))
        # NaN and infinities arrive as JSON constants the strict schema refuses as numbers.
        if "response_logprobs" in loc.split("."):
            return Rejection("logprob_not_finite", f"{loc}: {msg}")
        if "response arrays differ in length" in msg:
            return Rejection("misaligned_arrays", f"{loc}: {msg}")
    return Rejection("undecodable", error.detail[:2000])
