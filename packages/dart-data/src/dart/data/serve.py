"""``dart-data serve --config FILE``: the data manager alone (this package's dependencies only).

Reads the run config's shared sections, ``data`` and ``suite`` (see :mod:`dart.runtime.serving` and
:func:`dart.data.tasks.resolve_tasks`); where the suite's tasks name requirements, the env pool
``data.env_pool`` is asked which it runs (:func:`dart.data.tasks.runnable_on_pool`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from pydantic import Field

from dart.data import __version__
from dart.data.config import DataConfig
from dart.data.service import DataService
from dart.data.tasks import resolve_tasks, runnable_on_pool
from dart.runtime.bus import Bus
from dart.runtime.serving import ServeConfig, serve_until_stopped, service_main
from dart.runtime.store import open_store
from dart.runtime.telemetry import Telemetry


class DataServeConfig(ServeConfig):
    """What the data manager reads of a run config."""

    data: DataConfig = Field(default_factory=DataConfig)
    suite: str = "builtin:smoke"
    """The tasks to curate: a suite file, or (with dart-env installed) ``builtin:...`` / ``osworld:<dir>``."""
    max_steps: int | None = Field(default=None, ge=1, le=1000)
    """Step budget of every task of ``suite``; None keeps each task's own (the run config's ``max_steps``)."""


async def run_data(config: DataServeConfig, bus: Bus, telemetry: Telemetry, stop: asyncio.Event) -> None:
    """Serve the data manager until ``stop`` is set (first asking the env pool which tasks it runs, where the
    suite's tasks name requirements)."""
    data = config.data
    suite = resolve_tasks(config.suite, max_steps=config.max_steps)
    tasks = await runnable_on_pool(bus, suite, data.env_pool, timeout_s=data.capabilities_timeout_s)
    service = DataService(
        data,
        bus,
        open_store(config.store_config()),
        tasks.tasks,
        telemetry,
        tasks_excluded=tasks.excluded,
        tasks_excluded_by=tasks.excluded_by,
    )
    await serve_until_stopped(service, "data", telemetry, stop)


def command(argv: Sequence[str] | None = None) -> int:
    """``dart-data serve --config FILE`` with ``argv`` (default: the process's); returns the exit code."""
    return service_main("data", DataServeConfig, run_data, version=__version__, argv=argv)


def main() -> None:
    sys.exit(command())


if __name__ == "__main__":
    main()
