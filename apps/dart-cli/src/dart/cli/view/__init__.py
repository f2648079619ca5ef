"""``dart view RUN_DIR`` / ``dart view --config FILE``: a local, read-only web app showing what the agent did.

It opens the run's trajectory index read-only and its artifact store (:mod:`dart.cli.view.source`;
a run with ``run.artifacts: embedded_s3`` gets its S3 server started again on ``<run_dir>/s3``, and
stopped when the viewer exits) and serves the pages of :mod:`dart.cli.view.app` with uvicorn. The first
stdout line is the URL it serves on (``--port 0`` picks a free port). Exit code 2 when the path is not
a run (no config, no index, an index of another schema version) or the port cannot be bound.

Beyond loopback (``--host``) it needs ``--token TOKEN_FILE``: every request must carry that token
(:mod:`dart.cli.view.access`).

The overview adds the services' telemetry figures over the run summary's window (``figures``); a run in
progress gets a page that fetches itself again every few seconds. ``dart report`` writes the same pages
as files (:mod:`dart.cli.report`).

Modules: ``source`` (where the index and store are), ``queries`` (the SQL), ``figures`` (utilization,
versions, held-out success and staleness from telemetry), ``artifacts`` (blobs and images), ``overlay``
(an action as shapes over a screenshot), ``tokens`` (token texts from the policy's tokenizer), ``links``
(where links point: routes or a report's files), ``render`` (templates), ``hosts`` and ``access`` (which
requests are answered), ``app`` (the pages and routes).
"""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

RunDirArgument = Annotated[Path | None, typer.Argument(help="The run directory `dart run` wrote.", show_default=False)]
ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", help="A deployment's run config instead: its data.database_url and store."),
]
TelemetryOption = Annotated[
    Path | None,
    typer.Option("--telemetry", help="The services' telemetry JSONL directory (default: RUN_DIR/telemetry)."),
]
"""How ``dart view`` and ``dart report`` name the run they read."""


def view(
    run_dir: RunDirArgument = None,
    config: ConfigOption = None,
    telemetry: TelemetryOption = None,
    host: Annotated[
        str,
        typer.Option(help="Address to serve on (loopback by default; beyond it, --token is required)."),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to serve on; 0 picks a free one.")] = 8765,
    token: Annotated[
        Path | None,
        typer.Option(
            "--token",
            metavar="TOKEN_FILE",
            help="File holding the token every request must carry (required with a --host beyond loopback).",
        ),
    ] = None,
) -> None:
    """Look at a run's trajectories in the browser (read-only)."""
    # Imported here: `dart --help` must stay fast.
    import uvicorn

    from dart.cli.view.access import read_token
    from dart.cli.view.app import create_app
    from dart.cli.view.errors import NotARunError
    from dart.cli.view.hosts import LOOPBACK_HOSTS, is_loopback
    from dart.cli.view.source import open_run

    # SIGTERM as SIGINT: uvicorn re-raises the signal that stopped it, which must unwind (stopping the
    # embedded S3 server) rather than end the process on the spot.
    if token is None and not is_loopback(host):
        typer.echo(f"error: serving on {host}, beyond loopback, needs --token TOKEN_FILE", err=True)
        raise typer.Exit(2)
    try:
        secret = read_token(token) if token is not None else None
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with open_run(run_dir, config, telemetry) as source:
            # On loopback only requests addressed to loopback names are answered (no DNS rebinding).
            app = create_app(source, hosts=LOOPBACK_HOSTS if is_loopback(host) else None, token=secret)
            if secret is not None:
                typer.echo(
                    f"open the page once with ?token=<the token in {token}> (then a cookie carries it); "
                    "the traffic is plain HTTP",
                    err=True,
                )
            try:
                listener = socket.create_server((host, port), family=_family(host))
            except OSError as exc:
                typer.echo(f"error: cannot serve on {host}:{port}: {exc.strerror or exc}", err=True)
                raise typer.Exit(2) from exc
            bound = listener.getsockname()[1]
            typer.echo(f"http://{host if ':' not in host else f'[{host}]'}:{bound}/")
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
            server.run(sockets=[listener])
    except NotARunError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except KeyboardInterrupt:
        pass  # stopped by Ctrl-C or SIGTERM, after what it started was stopped


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def register(app: typer.Typer) -> None:
    """Add the ``view`` command to ``app``."""
    app.command("view")(view)
