"""``dart run``, ``dart warm-start`` and ``dart serve``: the pipeline on one machine, its warm start ahead of it,
or one service against external servers."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from dart.protocol.errors import ConfigError

Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="[KEY=VALUE]...",
        help="Settings over the file's and the environment's, e.g. run.rl_duration_s=30 train.lr=1e-5.",
        show_default=False,
    ),
]
PrintConfig = Annotated[
    bool, typer.Option("--print-config", help="Print the resolved config (file, environment, KEY=VALUE) and exit.")
]


def run_command(
    config: Annotated[
        str | None,
        typer.Argument(
            metavar="[CONFIG]", help="Run config YAML (see examples/); with --resume, none.", show_default=False
        ),
    ] = None,
    overrides: Overrides = None,
    print_config: PrintConfig = False,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Run the services on the Ray cluster at ADDRESS (host:port of its GCS), or on a throwaway one on "
            "this machine with 'local' (cluster.kind: ray, cluster.address: ADDRESS). Needs dart-cli[ray].",
        ),
    ] = None,
    resume_dir: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            metavar="RUN_DIR",
            help="Continue the run in RUN_DIR, killed as a whole, from where its data and checkpoints are "
            "(KEY=VALUE overrides apply over its config.yaml).",
            file_okay=False,
        ),
    ] = None,
) -> None:
    """Run warm start and decoupled RL on one machine; the last line printed is a JSON summary.

    A config error (a misspelt key, a bad value, a suite that does not resolve) ends with exit code 2 and one
    'error:' line, before anything is written.
    """
    from dart.cli.cluster.ray_cluster import ClusterError
    from dart.cli.stack.config import load_run_config
    from dart.cli.stack.run import check_for_dart_run, resume, run
    from dart.protocol.config import dump_config

    logging.basicConfig(level=logging.WARNING)
    overrides = [*(overrides or []), *(["cluster.kind=ray", f"cluster.address={ray}"] if ray is not None else [])]
    if resume_dir is not None and config is not None:  # with --resume every argument is an override
        overrides, config = [config, *overrides], None
    if config is None and resume_dir is None:
        typer.echo("error: give a run config, or --resume RUN_DIR", err=True)
        raise typer.Exit(2)
    try:
        if resume_dir is not None:
            summary = resume(resume_dir, overrides)
        else:
            assert config is not None
            path = _config_file(config)
            if print_config:
                resolved = load_run_config(path, overrides)
                check_for_dart_run(resolved, path)  # what dart run would refuse (its suites included) fails here too
                typer.echo(dump_config(resolved), nl=False)
                return
            summary = run(path, overrides)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except ClusterError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(summary))
    if summary.get("error"):
        raise typer.Exit(1)


def _config_file(config: str) -> Path:
    """``config`` as a path to an existing file.

    Raises:
        ConfigError: It is not one.
    """
    path = Path(config)
    if not path.is_file():
        raise ConfigError(config, "", "no such run config file")
    return path


def warm_start_command(
    config: Annotated[Path, typer.Argument(help="Run config YAML (see examples/).", exists=True, dir_okay=False)],
    overrides: Overrides = None,
) -> None:
    """Warm-start the policy 'dart run CONFIG' would start from, into warm_start.cache_dir, and print its
    cache key and figures as one JSON line.

    Runs of the same config (and any that differ only after the warm start) then begin with RL. Nothing is
    done when the entry is there already. A config error (no cache_dir, no warm start) ends with exit code 2;
    a warm start cut short (by warm_start.max_seconds, or by the guard against a stuck machine) is not kept and
    ends with exit code 1.
    """
    from dart.cli.stack.run import prepare_warm_start

    logging.basicConfig(level=logging.WARNING)
    try:
        prepared = prepare_warm_start(config, overrides or [])
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(prepared))
    if not prepared["stored"]:
        steps, planned = prepared.get("warm_start_steps"), prepared.get("warm_start_planned_steps")
        by = prepared.get("warm_start_cut_by")
        setting = "warm_start.max_seconds" if by == "max_seconds" else "the guard (warm_start.max_slowdown)"
        typer.echo(f"error: {setting} cut the warm start short at step {steps} of {planned}: not kept", err=True)
        raise typer.Exit(1)


def serve_command(
    service: Annotated[str, typer.Argument(help="Which service: env, rollout, data or train.")],
    config: Annotated[Path, typer.Option("--config", "-c", help="Run config YAML.", exists=True, dir_okay=False)],
    overrides: Overrides = None,
    print_config: PrintConfig = False,
) -> None:
    """Run one service against the NATS server and artifact store named in the config, until SIGTERM.

    The whole run config is validated first; then the service's package serves it, exactly as its own
    command ('dart-env serve --config FILE KEY=VALUE ...', likewise dart-data, dart-rollout, dart-train)
    would. A config error ends with exit code 2, a fatal error with exit code 1; either with one 'error:'
    line on stderr.
    """
    from dart.cli.stack.config import load_run_config
    from dart.cli.stack.services import service_command
    from dart.protocol.config import dump_config

    if service not in ("env", "rollout", "data", "train"):
        typer.echo(f"error: unknown service {service!r}; choose env, rollout, data or train", err=True)
        raise typer.Exit(2)
    try:
        resolved = load_run_config(config, overrides or [])
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if print_config:
        typer.echo(dump_config(resolved), nl=False)
        return
    argv = ["serve", "--config", str(config), *(overrides or [])]
    raise typer.Exit(service_command(service)(argv))  # type: ignore[arg-type]


def register(app: typer.Typer) -> None:
    """Add ``dart run``, ``dart warm-start`` and ``dart serve``."""
    app.command("run")(run_command)
    app.command("warm-start")(warm_start_command)
    app.command("serve")(serve_command)
