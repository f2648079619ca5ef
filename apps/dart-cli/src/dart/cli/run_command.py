"""``dart run`` and ``dart serve``: the pipeline on one machine, or one service against external servers."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dart.protocol.errors import ConfigError

if TYPE_CHECKING:
    from dart.cli.stack.config import RunConfig


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
    """Run one service against the NATS server and artifact store named in the config, until SIGTERM."""
    from dart.cli.stack.config import load_run_config

    if service not in ("env", "rollout", "data", "train"):
        typer.echo(f"error: unknown service {service!r}; choose env, rollout, data or train", err=True)
        raise typer.Exit(2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_run_config(config)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if service == "train" and cfg.train.backend.world_size > 1:
        if "RANK" not in os.environ:
            from dart.cli.stack.services import launch_trainer_ranks

            raise typer.Exit(launch_trainer_ranks(config, cfg.train.backend.world_size))
        from dart.cli.stack.services import follow_trainer, rank_status
        from dart.protocol.lifetime import exit_with_parent

        # torchrun starts each rank in its own session: a SIGKILL of its agent would leave ranks waiting in a
        # collective forever, so each rank goes when the agent goes.
        exit_with_parent()
        with rank_status():
            if os.environ["RANK"] != "0":
                follow_trainer(cfg)
            else:
                _serve_or_exit(cfg, service)
        return
    _serve_or_exit(cfg, service)


def _serve_or_exit(cfg: RunConfig, service: str) -> None:
    """Serve; a fatal error is logged with its traceback and ends the process with exit code 1 and one
    line on stderr naming the service and the error, so that an orchestrator (``dart run``'s supervisor,
    docker, systemd) restarts it."""
    from dart.cli.stack.services import serve

    try:
        asyncio.run(serve(cfg, service))  # type: ignore[arg-type]
    except Exception as exc:
        logging.getLogger("dart.cli").exception("dart serve %s failed", service)
        message = " ".join(str(exc).split())  # one line, whatever the exception's text
        typer.echo(f"error: dart serve {service} failed: {type(exc).__name__}: {message}", err=True)
        raise typer.Exit(1) from None


def register(app: typer.Typer) -> None:
    """Add ``dart run`` and ``dart serve``."""
    app.command("run")(run_command)
    app.command("serve")(serve_command)
