"""The data manager's tasks: a run config's ``suite`` resolved to TaskSpecs, less those the env pool does not run.

Suite files (:mod:`dart.protocol.suite`) load with this package alone; ``<source>:<name>`` suites come from
the suite sources registered with :data:`dart.protocol.suite.SUITE_SOURCES` (dart-env's ``builtin:`` and
``osworld:``, when dart-env is installed beside it; a standalone data host names a suite file). This
package never imports dart-env.

Tasks that name requirements (OSWorld's: ``app:chrome``, ``metric:compare_table``) are kept only where the
env pool says it meets them (:func:`runnable_on_pool`, over the bus): the runnable set is the pool's
provider's to decide, not this host's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from dart.protocol.messages import TaskSpec
from dart.protocol.suite import load_suite, resolve_suite
from dart.runtime.bus import Bus
from dart.runtime.capabilities import RunnableTasks, needs_capabilities, request_capabilities, runnable_tasks

log = logging.getLogger("dart.data")


def load_task_suite(path: str | Path) -> list[TaskSpec]:
    """A suite file's tasks, its defaults applied.

    Raises:
        SuiteError: The file is missing, not YAML/JSON, or a task does not validate.
    """
    return list(load_suite(path).tasks)


def resolve_tasks(spec: str, *, max_steps: int | None = None) -> list[TaskSpec]:
    """The tasks a run config's ``suite`` names (see :func:`dart.protocol.suite.resolve_suite`), each with
    ``max_steps`` as its step budget when given.

    Raises:
        ConfigError: A suite source that is not registered here, or a name it does not have.
        SuiteError: The suite file is missing or invalid.
    """
    return list(resolve_suite(spec, max_steps=max_steps).tasks)


async def runnable_on_pool(bus: Bus, tasks: Sequence[TaskSpec], pool: str, *, timeout_s: float) -> RunnableTasks:
    """The tasks the env pool runs: all of them when none names a requirement, else those whose requirements
    the pool reports it meets (asked over the bus, waiting up to ``timeout_s`` for the pool to answer).

    Raises:
        EnvPoolUnreachableError: The pool did not answer within ``timeout_s``.
        NoRunnableTaskError: The pool runs none of the tasks.
    """
    if not needs_capabilities(tasks):
        return RunnableTasks(tuple(tasks), 0)
    capabilities = await request_capabilities(bus, pool, timeout_s=timeout_s)
    runnable = runnable_tasks(tasks, capabilities)
    log.info(
        "env pool %s (%s, provider %s) runs %d of %d tasks; left out by what the pool lacks: %s",
        pool,
        capabilities.backend,
        capabilities.provider,
        len(runnable.tasks),
        len(tasks),
        runnable.excluded_by or "none",
    )
    return runnable
