"""``dart-env serve --config FILE``: the env service alone (this package's dependencies only).

Reads the run config's shared sections and ``env`` (see :mod:`dart.protocol.serving`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from pydantic import Field

from dart.env import __version__
from dart.env.service import EnvService, EnvServiceConfig
from dart.protocol.bus import Bus
from dart.protocol.serving import ServeConfig, serve_until_stopped, service_main
from dart.protocol.store import open_store
from dart.protocol.telemetry import Telemetry


class EnvServeConfig(ServeConfig):
    """What the env service reads of a run config."""

    env: EnvServiceConfig = Field(default_factory=EnvServiceConfig)


async def run_env(config: EnvServeConfig, bus: Bus, telemetry: Telemetry, stop: asyncio.Event) -> None:
    """Serve the env pool until ``stop`` is set."""
    service = EnvService(config.env, bus, telemetry=telemetry, store=open_store(config.store_config()))
    await serve_until_stopped(service, "env", telemetry, stop)


def command(argv: Sequence[str] | None = None) -> int:
    """``dart-env serve --config FILE`` with ``argv`` (default: the process's); returns the exit code."""
    return service_main("env", EnvServeConfig, run_env, version=__version__, argv=argv)


def main() -> None:
    sys.exit(command())


if __name__ == "__main__":
    main()
