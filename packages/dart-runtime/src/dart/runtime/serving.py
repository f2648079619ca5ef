"""Serve one DART service from a config file: what every package's ``dart-<service> serve`` shares.

Each service package (dart-env, dart-data, dart-rollout, dart-train) has a command that serves it with
only that package's dependencies::

    dart-env serve --config run.yaml        # likewise dart-data, dart-rollout, dart-train

The file is a run config (the one ``dart run`` writes into its run directory, or one written by hand for a
deployment): each service reads the shared sections (``run``: name, run directory, torch threads; ``bus``;
``store``; ``telemetry``) and its own (``env``, ``data`` with ``suite`` and ``max_steps``, ``rollout``, ``train``), and
ignores the sections of the others, so one file can serve every host. Keys outside the run config's
sections are refused, naming the key. Environment overrides (``DART_<SECTION>__<FIELD>``) apply.

Lifecycle of a served service::

    config loaded -> telemetry set up -> bus connected -> body starts the service (event ``service.ready``)
        -> serves until SIGINT/SIGTERM (or its own end) -> bus drained -> telemetry flushed -> exit 0

SIGUSR1 writes every thread's and every asyncio task's stack to stderr (:mod:`dart.runtime.stacks`):
``dart run`` sends it to a service that did not stop in time, just before killing it.

A config error ends the process with exit code 2, a fatal error with exit code 1; either way the last
stderr line is ``error: ...`` naming the service and the error (the log keeps the traceback), so an
orchestrator (``dart run``'s supervisor, docker, systemd) restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import ConfigDict, Field, model_validator

from dart.protocol.config import ConfigModel, command_line_overrides, load_config
from dart.protocol.errors import ConfigError
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.lifetime import stop_signals_end_startup
from dart.runtime.stacks import dump_stacks_on_signal
from dart.runtime.store import StoreConfig
from dart.runtime.telemetry import Telemetry, TelemetryConfig, setup_telemetry

log = logging.getLogger(__name__)

RUN_CONFIG_SECTIONS = frozenset(
    {
        "run",
        "bus",
        "store",
        "telemetry",
        "model",
        "warm_start",
        "suite",
        "max_steps",
        "env",
        "rollout",
        "data",
        "train",
        "validation",
        "cluster",
    }
)
"""Top-level keys of a run config (``dart.cli.stack.config.RunConfig``'s fields; a test keeps them equal)."""


class ServeRunSection(ConfigModel):
    """What a served service reads of the ``run`` section; its other keys belong to ``dart run``."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(default="run", pattern=r"^[A-Za-z0-9_-]+$")
    """Run name; also the NATS run token (streams are scoped to it)."""
    run_dir: Path | None = None
    """Run directory: telemetry goes to ``<run_dir>/telemetry/<service>.jsonl``, artifacts to
    ``<run_dir>/artifacts`` when ``store`` is not set."""
    torch_threads: int | None = Field(default=None, ge=1)
    """Intra-op threads of torch in this process (engines, trainer); None: torch's default."""


def store_or_local(store: StoreConfig | None, run_dir: Path | None, source: str) -> StoreConfig:
    """``store`` when set, else the local store under ``<run_dir>/artifacts`` (how every config names its store).

    Raises:
        ConfigError: Neither is set (``source`` names the config in the message).
    """
    if store is not None:
        return store
    if run_dir is None:
        raise ConfigError(source, "store", "set store (or run.run_dir for a local store under it)")
    return StoreConfig(uri=(run_dir.resolve() / "artifacts").as_uri())


class ServeConfig(ConfigModel):
    """The sections every served service reads; a service's config adds its own section."""

    model_config = ConfigDict(extra="ignore")

    run: ServeRunSection = Field(default_factory=ServeRunSection)
    bus: BusConfig = Field(default_factory=BusConfig)
    store: StoreConfig | None = None
    """Artifact store; None uses ``file://<run_dir>/artifacts``."""
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)

    @model_validator(mode="before")
    @classmethod
    def _only_run_config_sections(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(str(k) for k in data if k not in RUN_CONFIG_SECTIONS)
            if unknown:
                raise ValueError(f"unknown section(s) {unknown}: a run config has {sorted(RUN_CONFIG_SECTIONS)}")
        return data

    def store_config(self) -> StoreConfig:
        """The artifact store (the run directory's local store by default).

        Raises:
            ConfigError: Neither ``store`` nor ``run.run_dir`` is set.
        """
        return store_or_local(self.store, self.run.run_dir, "serve config")

    def telemetry_for(self, service: str, version: str) -> Telemetry:
        """Telemetry of ``dart-<service>``, writing ``<run_dir>/telemetry/<service>.jsonl`` when the run
        directory is set (trackers write under it too)."""
        config = self.telemetry
        if self.run.run_dir is not None and config.jsonl_path is None:
            config = config.model_copy(update={"jsonl_path": self.run.run_dir / "telemetry" / f"{service}.jsonl"})
        if self.run.run_dir is not None and config.run_dir is None:
            config = config.model_copy(update={"run_dir": self.run.run_dir})
        return setup_telemetry(f"dart-{service}", version=version, run_id=self.run.name, config=config)


C = TypeVar("C", bound=ServeConfig)

ServiceBody = Callable[[C, Bus, Telemetry, asyncio.Event], Awaitable[None]]
"""Runs a service until ``stop`` is set (or it ends by itself), then stops it gracefully."""


class Startable(Protocol):
    """A service that starts and stops (env, data manager, rollout)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def serve_until_stopped(service: Startable, name: str, telemetry: Telemetry, stop: asyncio.Event) -> None:
    """Start ``service``, record ``service.ready``, serve until ``stop`` is set, then stop it gracefully."""
    await service.start()
    try:
        telemetry.event("service.ready", service=name)
        await stop.wait()
    finally:
        await service.stop()


async def serve(
    service: str, config: C, body: ServiceBody[C], *, version: str, stop: asyncio.Event | None = None
) -> None:
    """Run ``body`` with telemetry and a connected bus until ``stop`` is set or SIGINT/SIGTERM arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    dump_stacks_on_signal(loop)  # where it hangs, should it not stop
    if config.run.torch_threads:
        with contextlib.suppress(ImportError):
            import torch

            torch.set_num_threads(config.run.torch_threads)
    telemetry = config.telemetry_for(service, version)
    bus_config = config.bus.model_copy(update={"run": config.run.name, "name": f"dart-{service}"})
    try:
        with telemetry.activate():
            telemetry.event("service.start", service=service)
            bus = await Bus.connect(bus_config, tracer_provider=telemetry.tracer_provider)
            try:
                await body(config, bus, telemetry, stop)
            finally:
                await bus.drain()
            telemetry.event("service.stop", service=service)
    finally:
        telemetry.shutdown()


def load_serve_config(config_type: type[C], path: Path, overrides: Sequence[str] = ()) -> C:
    """Load a service's config from a run config file (environment overrides apply, then ``KEY=VALUE``
    command-line ``overrides``)."""
    return load_config(
        config_type, path, overrides=command_line_overrides(config_type, overrides), overrides_source="command line"
    )


def serve_or_exit(service: str, config: C, body: ServiceBody[C], *, version: str) -> int:
    """Serve; returns 0 after a graceful stop. A fatal error is logged with its traceback and gives exit
    code 1 with one ``error:`` line on stderr naming the service and the error."""
    try:
        asyncio.run(serve(service, config, body, version=version))
    except Exception as exc:
        log.exception("dart serve %s failed", service)
        message = " ".join(str(exc).split())  # one line, whatever the exception's text
        print(f"error: dart serve {service} failed: {type(exc).__name__}: {message}", file=sys.stderr)
        return 1
    return 0


def service_main(
    service: str,
    config_type: type[C],
    body: ServiceBody[C],
    *,
    version: str,
    argv: Sequence[str] | None = None,
    before: Callable[[C, Path, Sequence[str]], int | None] | None = None,
) -> int:
    """The ``dart-<service>`` command: ``serve --config FILE [KEY=VALUE ...]``; returns the exit code.

    ``before(config, path, overrides)``, when given, runs after the config loaded and may end the command
    with its exit code instead of serving (the trainer launches its ranks there, with the same overrides).
    """
    stop_signals_end_startup()  # until serve() installs its loop's handlers
    parser = argparse.ArgumentParser(prog=f"dart-{service}", description=f"The DART {service} service.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help=f"Serve the {service} service until SIGTERM.")
    serve_parser.add_argument("--config", "-c", type=Path, required=True, help="Run config YAML.")
    serve_parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="Settings over the file's, e.g. train.lr=1e-5."
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_serve_config(config_type, args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if before is not None:
        code = before(config, args.config, args.overrides)
        if code is not None:
            return code
    return serve_or_exit(service, config, body, version=version)
