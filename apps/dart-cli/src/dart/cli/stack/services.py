"""One service of a run, as its package serves it: the code behind ``dart serve``.

``dart serve <service> --config FILE`` validates the whole run config, then hands the file to the
service package's own command (``dart-env serve``, ``dart-data serve``, ``dart-rollout serve``,
``dart-train serve``; see :mod:`dart.runtime.serving`), so a service behaves the same under ``dart run``,
``dart serve`` and its package's command on a host that has only that package.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from dart.cli.stack.config import RunConfig, ServiceName
from dart.runtime.serving import ServeConfig, ServeRunSection
from dart.runtime.serving import serve as serve_service


def service_command(service: ServiceName) -> Callable[[Sequence[str] | None], int]:
    """The ``dart-<service>`` command of the service's package (it exits with what this returns)."""
    if service == "env":
        from dart.env.serve import command
    elif service == "data":
        from dart.data.serve import command
    elif service == "rollout":
        from dart.rollout.serve import command
    elif service == "train":
        from dart.train.serve import command
    else:  # pragma: no cover - typer and ServiceName restrict the choice
        raise ValueError(f"unknown service {service!r}")
    return command


def served(config: RunConfig, service: ServiceName) -> tuple[ServeConfig, Any]:
    """What the service's package reads of a run config, and the body that serves it."""
    shared: dict[str, Any] = {
        "run": ServeRunSection(
            name=config.run.name, run_dir=config.run.run_dir, torch_threads=config.run.torch_threads
        ),
        "bus": config.bus,
        "store": config.store,
        "telemetry": config.telemetry,
    }
    if service == "env":
        from dart.env.serve import EnvServeConfig, run_env

        # The run's suite where its config names one (a config file that names none runs the generated tasks).
        suite = config.suite if "suite" in config.model_fields_set else None
        return EnvServeConfig(**shared, env=config.env, suite=suite), run_env
    if service == "data":
        from dart.data.serve import DataServeConfig, run_data

        return DataServeConfig(**shared, data=config.data, suite=config.suite, max_steps=config.max_steps), run_data
    if service == "rollout":
        from dart.rollout.serve import RolloutServeConfig, run_rollout

        return RolloutServeConfig(**shared, rollout=config.rollout), run_rollout
    if service == "train":
        from dart.train.serve import TrainServeConfig, run_train

        return TrainServeConfig(**shared, train=config.train), run_train
    raise ValueError(f"unknown service {service!r}")  # pragma: no cover


async def serve(config: RunConfig, service: ServiceName, stop: asyncio.Event | None = None) -> None:
    """Run one service of ``config`` in this process until ``stop`` is set or SIGINT/SIGTERM arrives."""
    from dart.cli import __version__

    serve_config, body = served(config, service)
    await serve_service(service, serve_config, body, version=__version__, stop=stop)
