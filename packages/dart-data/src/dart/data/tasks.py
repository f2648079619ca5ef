"""The data manager's tasks: a run config's ``suite`` resolved to TaskSpecs.

Suite files (:mod:`dart.protocol.suite`) load with this package alone; ``<source>:<name>`` suites come from
the suite sources registered with :data:`dart.protocol.suite.SUITE_SOURCES` (dart-env's ``builtin:`` and
``osworld:``, when dart-env is installed beside it; a standalone data host names a suite file). This
package never imports dart-env.
"""

from __future__ import annotations

from pathlib import Path

from dart.protocol.messages import TaskSpec
from dart.protocol.suite import load_suite, resolve_suite


def load_task_suite(path: str | Path) -> list[TaskSpec]:
    """A suite file's tasks, its defaults applied.

    Raises:
        SuiteError: The file is missing, not YAML/JSON, or a task does not validate.
    """
    return list(load_suite(path).tasks)


def resolve_tasks(spec: str) -> list[TaskSpec]:
    """The tasks a run config's ``suite`` names (see :func:`dart.protocol.suite.resolve_suite`).

    Raises:
        ConfigError: A suite source that is not registered here, or a name it does not have.
        SuiteError: The suite file is missing or invalid.
    """
    return list(resolve_suite(spec).tasks)
