"""The data manager's tasks: a run config's ``suite`` resolved to TaskSpecs.

Suite files (:mod:`dart.protocol.suite`) load with this package alone; the suites shipped with the env
backends (``builtin:...``) and OSWorld task directories (``osworld:<dir>``) need dart-env installed beside
it (``dart run`` has it; a standalone data host names a suite file, or installs dart-env).
"""

from __future__ import annotations

from pathlib import Path

from dart.protocol.errors import ConfigError
from dart.protocol.messages import TaskSpec
from dart.protocol.suite import load_suite


def load_task_suite(path: str | Path) -> list[TaskSpec]:
    """A suite file's tasks, its defaults applied.

    Raises:
        SuiteError: The file is missing, not YAML/JSON, or a task does not validate.
    """
    return list(load_suite(path).tasks)


def resolve_tasks(spec: str) -> list[TaskSpec]:
    """The tasks a run config's ``suite`` names (see :func:`dart.env.suite.resolve_suite`).

    Raises:
        ConfigError: A shipped suite or OSWorld directory without dart-env installed, or one that does not exist.
        SuiteError: The suite file is missing or invalid.
    """
    if spec.startswith(("builtin:", "osworld:")):
        try:
            from dart.env.suite import resolve_suite
        except ImportError:
            raise ConfigError(
                "run config",
                "suite",
                f"{spec!r} ships with dart-env, which is not installed here: install it beside dart-data, "
                "or name a suite file",
            ) from None
        return list(resolve_suite(spec).tasks)
    return load_task_suite(spec)
