"""``dart run`` and ``dart serve``: the pipeline on one machine, or one service against external servers."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from dart.protocol.errors import ConfigError


def run_command(
    config: Annotated[Path, typer.Argument(help="Run config YAML (see examples/).", exists=True, dir_okay=False)],
) -> None:
    """Run warm start and decoupled RL on one machine; the last line printed is a JSON summary."""
    from dart.cli.stack.run import run

    logging.basicConfig(level=logging.WARNING)
    try:
        summary = run(config)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(summary))
    if summary.get("error"):
        raise typer.Exit(1)


def serve_command(
    service: Annotated[str, typer.Argument(help="Which service: env, rollout, data or train.")],
    config: Annotated[Path, typer.Option("--config", "-c", help="Run config YAML.", exists=True, dir_okay=False)],
) -> None:
    """Run one service against the NATS server and artifact store named in the config, until SIGTERM.

    The whole run config is validated first; then the service's package serves it, exactly as its own
    command ('dart-env serve --config FILE', likewise dart-data, dart-rollout, dart-train) would. A fatal
    error ends with exit code 1 and one 'error:' line on stderr.
    """
    from dart.cli.stack.config import load_run_config
    from dart.cli.stack.services import service_command

    if service not in ("env", "rollout", "data", "train"):
        typer.echo(f"error: unknown service {service!r}; choose env, rollout, data or train", err=True)
        raise typer.Exit(2)
    try:
        load_run_config(config)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(service_command(service)(["serve", "--config", str(config)]))  # type: ignore[arg-type]


def register(app: typer.Typer) -> None:
    """Add ``dart run`` and ``dart serve``."""
    app.command("run")(run_command)
    app.command("serve")(serve_command)
