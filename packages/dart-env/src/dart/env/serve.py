"""``dart-env serve --config FILE``: the env service alone (this package's dependencies only).

Reads the run config's shared sections and ``env`` (see :mod:`dart.runtime.serving`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from pydantic import Field

from dart.env import __version__
from dart.env.service import EnvService, EnvServiceConfig
from dart.runtime.bus import Bus
from dart.runtime.serving import ServeConfig, serve_until_stopped, service_main
from dart.runtime.store import open_store
from dart.runtime.telemetry import Telemetry


class EnvServeConfig(ServeConfig):
    """What the env service reads of a run config."""

    env: EnvServiceConfig = Field(default_factory=EnvServiceConfig)
    suite: str | None = None
    """The run's suite (the run config's ``suite``): the tasks the pool runs unless ``env.suites`` names its own.
    None (a run config that names no suite): the tasks the backend generates from their ids."""

    def pool(self) -> EnvServiceConfig:
        """The env section as served: ``env.suites`` defaults to the run's suite, resolved on this host as the
        data manager resolves it on its own."""
        if self.env.suites or self.suite is None:
            return self.env
        return self.env.model_copy(update={"suites": (self.suite,)})


async def run_env(config: EnvServeConfig, bus: Bus, telemetry: Telemetry, stop: asyncio.Event) -> None:
    """Serve the env pool until ``stop`` is set."""
    service = EnvService(config.pool(), bus, telemetry=telemetry, store=open_store(config.store_config()))
    await serve_until_stopped(service, "env", telemetry, stop)


def command(argv: Sequence[str] | None = None) -> int:
    """``dart-env serve --config FILE`` with ``argv`` (default: the process's); returns the exit code."""
    return service_main("env", EnvServeConfig, run_env, version=__version__, argv=argv)


def main() -> None:
    sys.exit(command())


if __name__ == "__main__":
    main()
