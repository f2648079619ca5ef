"""Task suites: files (YAML or JSON) listing tasks, the one format every service reads.

The env service runs their tasks, the data manager curates them, ``dart eval`` evaluates them. Format::

    name: sim-basic
    backend: sim            # default backend for tasks that do not name one
    max_steps: 8            # default step budget
    tasks:
      - task_id: sim/click-button/0
        instruction: Click the OK button
        params: {family: click-button, difficulty: easy, seed: 0}

A run config's ``suite`` is a suite file path or ``<source>:<name>``, resolved by :func:`resolve_suite`
through :data:`SUITE_SOURCES` (entry-point group ``dart.suites``): dart-env registers ``builtin`` (the suites
its backends ship) and ``osworld`` (an OSWorld task directory); another package may add its own source.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dart.protocol.errors import ConfigError, SuiteError
from dart.protocol.messages import TaskSpec
from dart.protocol.registry import Registry


class TaskSuite(BaseModel):
    """A named, validated list of tasks with unique ids."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    tasks: tuple[TaskSpec, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> TaskSuite:
        seen: set[str] = set()
        for task in self.tasks:
            if task.task_id in seen:
                raise ValueError(f"duplicate task_id {task.task_id!r}")
            seen.add(task.task_id)
        return self

    def by_id(self, task_id: str) -> TaskSpec:
        """The task with this id.

        Raises:
            KeyError: No such task in the suite.
        """
        for task in self.tasks:
            if task.task_id == task_id:
                return task
        raise KeyError(f"task {task_id!r} is not in suite {self.name!r}")


def load_suite(path: str | Path) -> TaskSuite:
    """Load and validate a suite file.

    Raises:
        SuiteError: The file is missing, unreadable, or invalid; the message names the file and
            the offending task/field.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SuiteError(str(path), f"cannot read: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SuiteError(str(path), f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from None
    if not isinstance(doc, dict):
        raise SuiteError(str(path), "top level must be a mapping with 'name' and 'tasks'")
    defaults = {k: doc.pop(k) for k in ("backend", "max_steps") if k in doc}
    tasks_raw = doc.get("tasks")
    if isinstance(tasks_raw, list):
        doc["tasks"] = [{**defaults, **t} if isinstance(t, dict) else t for t in tasks_raw]
    try:
        # Through JSON so the strict wire types (tuples, enums) accept what YAML produces.
        return TaskSuite.model_validate_json(json.dumps(doc))
    except (TypeError, ValueError) as exc:
        if not isinstance(exc, ValidationError):
            raise SuiteError(str(path), f"values are not JSON-compatible: {exc}") from None
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise SuiteError(str(path), f"{loc}: {err['msg']} ({exc.error_count()} error(s))") from None


def dump_suite(suite: TaskSuite) -> dict[str, Any]:
    """The suite as plain data (for writing YAML/JSON)."""
    return {"name": suite.name, "tasks": [t.model_dump(mode="json") for t in suite.tasks]}


SuiteSource = Callable[[str], "TaskSuite"]
"""Resolves the name after ``<source>:`` to a suite; raises :class:`~dart.protocol.errors.ConfigError`
(field ``suite``) for a name it does not have."""


def _is_source(obj: object) -> None:
    if not callable(obj):
        raise TypeError(f"a suite source must be callable (name) -> TaskSuite, got {obj!r}")


SUITE_SOURCES: Registry[SuiteSource] = Registry("suites", what="suite source", config_field="suite", check=_is_source)
"""Suite sources by the prefix of ``suite`` (``builtin``, ``osworld`` with dart-env installed)."""

_SOURCE_SPEC = re.compile(r"^([a-z][a-z0-9_-]*):(.*)$")


def resolve_suite(spec: str, *, max_steps: int | None = None) -> TaskSuite:
    """The suite a run config's ``suite`` names: ``<source>:<name>`` through :data:`SUITE_SOURCES`, or a
    suite file path; with ``max_steps``, every task's step budget is that (a run's ``max_steps``).

    Raises:
        ConfigError: A source nobody registered (the message lists those that are), or a name its source
            does not have (field ``suite``).
        SuiteError: The suite file is missing or invalid.
    """
    suite = _resolve(spec)
    if max_steps is None:
        return suite
    return suite.model_copy(update={"tasks": tuple(t.model_copy(update={"max_steps": max_steps}) for t in suite.tasks)})


def _resolve(spec: str) -> TaskSuite:
    match = _SOURCE_SPEC.match(spec)
    if match is None or Path(spec).exists():
        return load_suite(spec)
    source, name = match.groups()
    if source not in SUITE_SOURCES.names():
        known = ", ".join(f"{s}:" for s in SUITE_SOURCES.names()) or "none"
        hint = " (the built-in suites ship with dart-env: install it here)" if source in ("builtin", "osworld") else ""
        raise ConfigError("run config", "suite", f"no suite source {source!r} is registered{hint}; registered: {known}")
    return SUITE_SOURCES.get(source)(name)
