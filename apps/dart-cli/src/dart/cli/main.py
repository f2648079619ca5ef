"""The ``dart`` command.

Each subcommand lives in its own module exposing ``register(app)``, which adds its command (or a
sub-app with ``app.add_typer``) to :data:`app`; adding one (``run``, ``serve``, ``report``,
``view``, ``model``, ``env``) means writing the module and listing it in :data:`COMMAND_MODULES`.
Modules import heavy dependencies (torch, services) inside their commands, so ``dart --help``
stays fast.
"""

from __future__ import annotations

from types import ModuleType
from typing import Annotated

import typer

from dart.cli import doctor, env_command, eval_command, model, nats_server, report, run_command, topology_command, view
from dart.cli.versions import version_text

app = typer.Typer(
    name="dart",
    help="DART: decoupled multi-turn RL for GUI agents.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
)

COMMAND_MODULES: tuple[ModuleType, ...] = (
    run_command,
    eval_command,
    report,
    view,
    doctor,
    nats_server,
    topology_command,
    model,
    env_command,
)
"""Modules whose ``register(app)`` adds a subcommand, in help order."""


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-V",
            help="Print DART's version and those of its packages.",
            callback=_print_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """DART: decoupled multi-turn RL for GUI agents."""


for _module in COMMAND_MODULES:
    _module.register(app)


if __name__ == "__main__":
    app(prog_name="dart")
