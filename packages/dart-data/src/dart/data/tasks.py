"""A convenience loader of task suite files (the orchestrator usually passes TaskSpecs itself).

A suite is YAML: ``name``, optional defaults ``backend`` and ``max_steps``, and ``tasks``, a list
of :class:`~dart.protocol.messages.TaskSpec` mappings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dart.data.errors import SuiteError
from dart.protocol.messages import TaskSpec


def load_task_suite(path: str | Path) -> list[TaskSpec]:
    """Read a suite file's tasks, applying its defaults.

    Raises:
        SuiteError: The file is missing, not YAML, or a task does not validate.
    """
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SuiteError(str(path), str(exc)) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("tasks"), list):
        raise SuiteError(str(path), "expected a mapping with a 'tasks' list")
    defaults = {k: doc[k] for k in ("backend", "max_steps") if k in doc}
    tasks = []
    for i, raw in enumerate(doc["tasks"]):
        if not isinstance(raw, dict):
            raise SuiteError(str(path), f"tasks[{i}] is not a mapping")
        spec: dict[str, Any] = {**defaults, **raw}
        if "tags" in spec and isinstance(spec["tags"], list):
            spec["tags"] = tuple(spec["tags"])
        try:
            tasks.append(TaskSpec.model_validate(spec))
        except ValidationError as exc:
            raise SuiteError(str(path), f"tasks[{i}]: {exc}") from exc
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise SuiteError(str(path), "duplicate task_id")
    return tasks
