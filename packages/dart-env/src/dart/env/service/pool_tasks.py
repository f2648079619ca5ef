"""Which task a reset runs: the env pool's own copy of the task the request names, never the body it carries.

A reset request carries a whole task (the rollout and eval roles send what the data manager emitted), and an
OSWorld task's body is a program for the desktop: setup commands, files to fetch, getters. So the env service
runs only the tasks it knows itself (:class:`PoolTasks`):

- with ``env.suites``: the tasks of those suites, resolved on this host as a run config's ``suite`` is
  (:func:`dart.protocol.suite.resolve_suite`); ``dart run`` and ``dart serve`` name the run's suite and
  held-out suite;
- without: the tasks the backend generates from their ids
  (:meth:`~dart.env.interface.EnvBackend.task_from_id`: the sim's, MiniWoB++'s); an OSWorld pool has none and
  refuses every reset.

A reset is refused (:class:`~dart.env.errors.TaskRefusedError`) when its task id is not the pool's
(``unknown_task``) or when the body it carries differs from the pool's copy (``altered_task``) in anything but
``max_steps`` (a run may set one step budget for all its tasks; no backend reads it). The env service answers
``invalid_request``, counts the refusal by reason and serves on; the lease stays its holder's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dart.env.errors import TaskRefusedError
from dart.protocol.errors import ConfigError, SuiteError
from dart.protocol.messages import TaskSpec
from dart.protocol.suite import resolve_suite

_UNCHECKED = frozenset({"max_steps"})
"""Task fields a sender may set without altering the task: no backend reads them."""

TaskGenerator = Callable[[str], TaskSpec | None]
"""A backend's :meth:`~dart.env.interface.EnvBackend.task_from_id`."""


class PoolTasks:
    """The tasks an env pool runs, by id; see the module docstring.

    Args:
        tasks: The tasks of the pool's suites by id; None when it has no suites (the backend's generated
            tasks only).
        source: Where they come from, for refusal messages.
    """

    def __init__(self, tasks: Mapping[str, TaskSpec] | None, source: str) -> None:
        self._tasks = dict(tasks) if tasks is not None else None
        self.source = source

    @classmethod
    def load(cls, suites: Sequence[str], backend: str) -> PoolTasks:
        """The tasks of ``suites`` (blocking: a suite may be a directory to read; call it off the event loop).

        Raises:
            ConfigError: A suite does not resolve, holds tasks of another backend than ``backend``, or shares a
                task id with another suite under a different body (field ``env.suites``).
        """
        if not suites:
            return cls(None, f"the tasks the {backend} backend generates from their ids (env.suites is empty)")
        tasks: dict[str, TaskSpec] = {}
        for spec in suites:
            try:
                suite = resolve_suite(spec)
            except (ConfigError, SuiteError) as exc:
                raise ConfigError("env config", "env.suites", f"suite {spec!r} does not resolve here: {exc}") from None
            for task in suite.tasks:
                if task.backend != backend:
                    raise ConfigError(
                        "env config",
                        "env.suites",
                        f"suite {spec!r} has task {task.task_id!r} for backend {task.backend!r}, but env.backend is "
                        f"{backend!r}",
                    )
                known = tasks.setdefault(task.task_id, task)
                if altered_fields(known, task):
                    raise ConfigError(
                        "env config", "env.suites", f"task {task.task_id!r} differs between the suites {list(suites)}"
                    )
        return cls(tasks, f"suite(s) {', '.join(suites)} ({len(tasks)} tasks)")

    def own(self, received: TaskSpec, generate: TaskGenerator) -> TaskSpec:
        """The pool's copy of the task ``received`` names, checked against ``received``.

        Args:
            received: The task a reset request carries.
            generate: The backend's :meth:`~dart.env.interface.EnvBackend.task_from_id` (used without suites).

        Raises:
            TaskRefusedError: The id is not the pool's (``unknown_task``) or the body differs (``altered_task``).
        """
        task_id = received.task_id
        own = self._tasks.get(task_id) if self._tasks is not None else generate(task_id)
        if own is None:
            raise TaskRefusedError(task_id, "unknown_task", f"is not among {self.source}")
        changed = altered_fields(own, received)
        if changed:
            raise TaskRefusedError(
                task_id, "altered_task", f"differs from its copy in {self.source}: {', '.join(changed)}"
            )
        return own


def altered_fields(own: TaskSpec, received: TaskSpec) -> list[str]:
    """The fields where ``received`` differs from ``own`` (``params.<key>`` for each differing parameter), but
    those a sender may set (``max_steps``). Values compare as canonical JSON: ``1``, ``1.0`` and ``true`` differ,
    and so do an absent key and ``null``."""
    mine, theirs = _body(own), _body(received)
    changed = [k for k in mine.keys() | theirs.keys() if k != "params" and _canonical(mine, k) != _canonical(theirs, k)]
    ours, sent = mine["params"], theirs["params"]
    changed += [f"params.{k}" for k in ours.keys() | sent.keys() if _canonical(ours, k) != _canonical(sent, k)]
    return sorted(changed)


def _canonical(values: dict[str, Any], key: str) -> str | None:
    return json.dumps(values[key], sort_keys=True) if key in values else None


def _body(task: TaskSpec) -> dict[str, Any]:
    # JSON form: a suite read from YAML and a task decoded from the wire compare alike (tuples, floats).
    return task.model_dump(mode="json", exclude=set(_UNCHECKED))
