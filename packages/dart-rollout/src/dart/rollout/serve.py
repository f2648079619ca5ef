"""``dart-rollout serve --config FILE``: the rollout service alone (this package's dependencies only).

Reads the run config's shared sections and ``rollout`` (see :mod:`dart.runtime.serving`). Once its
engines are up it records ``service.ready`` (``dart run`` starts its RL clock there).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from pydantic import Field

from dart.rollout import __version__
from dart.rollout.service import RolloutService
from dart.rollout.service.config import RolloutConfig
from dart.runtime.bus import Bus
from dart.runtime.serving import ServeConfig, serve_until_stopped, service_main
from dart.runtime.telemetry import Telemetry


class RolloutServeConfig(ServeConfig):
    """What the rollout service reads of a run config."""

    rollout: RolloutConfig = Field(default_factory=RolloutConfig)


async def run_rollout(config: RolloutServeConfig, bus: Bus, telemetry: Telemetry, stop: asyncio.Event) -> None:
    """Serve the rollout workers and engines until ``stop`` is set."""
    service = RolloutService(config.rollout, bus, telemetry=telemetry, store_config=config.store_config())
    await serve_until_stopped(service, "rollout", telemetry, stop)


def command(argv: Sequence[str] | None = None) -> int:
    """``dart-rollout serve --config FILE`` with ``argv`` (default: the process's); returns the exit code."""
    return service_main("rollout", RolloutServeConfig, run_rollout, version=__version__, argv=argv)


def main() -> None:
    sys.exit(command())


if __name__ == "__main__":
    main()
