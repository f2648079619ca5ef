"""Errors raised by dart-env."""

from __future__ import annotations

from dart.protocol.errors import DartError, SuiteError

__all__ = [
    "EnvError",
    "EpisodeStateError",
    "ForkRefusedError",
    "InstanceIdTakenError",
    "LayoutError",
    "SuiteError",
    "TaskParamsError",
    "TaskRefusedError",
]


class EnvError(DartError):
    """Base class of env service errors."""


class TaskParamsError(EnvError):
    """A task cannot run on this backend: wrong backend name or invalid ``params``.

    Attributes:
        task_id: The task.
        backend: The backend that rejected it.
        detail: What is wrong.
    """

    def __init__(self, task_id: str, backend: str, detail: str) -> None:
        self.task_id = task_id
        self.backend = backend
        self.detail = detail
        super().__init__(f"task {task_id!r} cannot run on the {backend} backend: {detail}")


class EpisodeStateError(EnvError):
    """An env backend was asked for something its lifecycle state does not allow.

    Attributes:
        operation: What was asked (``step``, ``evaluate`` ...).
        state: The backend's state at the time (``ready``, ``done``, ``closed`` ...).
    """

    def __init__(self, operation: str, state: str, hint: str) -> None:
        self.operation = operation
        self.state = state
        super().__init__(f"cannot {operation} while the env is {state}: {hint}")


class ForkRefusedError(EnvError):
    """An episode could not be forked exactly; the instance is sound and a plain reset may follow.

    Attributes:
        reason: ``fork_unsupported`` (the backend cannot fork), ``fork_ended`` (a replayed action ended the
            episode before the branch point) or ``fork_mismatch`` (a replayed screen differs from the parent's).
        detail: What happened.
    """

    REASONS = frozenset({"fork_unsupported", "fork_ended", "fork_mismatch"})

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in self.REASONS:
            raise ValueError(f"unknown fork refusal reason {reason!r}")
        self.reason = reason
        self.detail = detail
        super().__init__(f"fork refused ({reason}): {detail}")


class LayoutError(EnvError):
    """A simulated GUI task does not fit on the configured screen; use a larger screen size."""


class InstanceIdTakenError(EnvError):
    """Another process already serves an env instance id this service was about to serve.

    Several env service processes may share one pool (the lease subject is served in a queue
    group), but their instance ids must differ: give each process its own ``instance_prefix``.

    Attributes:
        instance_id: The instance id that is already served.
    """

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        super().__init__(
            f"env instance {instance_id!r} is already served by another process: "
            "set a distinct instance_prefix for each env service sharing a pool"
        )


class TaskRefusedError(EnvError):
    """A reset named a task the env pool does not run as sent: its id is not the pool's, or the body the
    request carries differs from the pool's own copy (see :mod:`dart.env.service.pool_tasks`).

    Attributes:
        task_id: The task the request named.
        reason: ``unknown_task`` (not among the pool's tasks) or ``altered_task`` (its body differs).
        detail: Where the pool's tasks come from, or which fields differ.
    """

    def __init__(self, task_id: str, reason: str, detail: str) -> None:
        self.task_id = task_id
        self.reason = reason
        self.detail = detail
        super().__init__(
            f"reset refused: task {task_id!r} {detail}; the env pool runs only its own copy of the tasks of its "
            "suites (env.suites): send the task as the suite holds it"
        )
