"""``dart nats``: an embedded nats-server with JetStream in the foreground, for development.

Lifecycle: start (prints the URL) -> serve until SIGINT/SIGTERM (exit 0) or until the server
dies (exit 1, with the tail of its log) -> stop the server and remove a temporary store. The last
line printed is a JSON summary.

With ``--print-config --run NAME`` it prints the config a deployment's nats-server uses instead
(``deploy/nats/nats.conf``: the same users, passwords from ``DART_NATS_<ROLE>_PASSWORD`` variables).

With ``--users-dir DIR --run NAME`` the server admits only DART's per-service users, each limited to
its subjects for that run (``dart.protocol.permissions``); passwords are created in ``DIR`` (0600) on
first use and kept, so ``dart serve`` processes connect with ``DART_BUS__USER=<role>`` and
``DART_BUS__PASSWORD_FILE=DIR/nats-<role>.password``.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from dart.cli.stack.secrets import write_bus_credentials
from dart.embedded.nats import EmbeddedNats, NatsUser, deployment_config
from dart.embedded.process import EmbeddedServerError, port_open
from dart.protocol.permissions import Permissions, service_permissions
from dart.protocol.subjects import DEFAULT_PREFIX
from dart.protocol.topology import ROLES


def _healthy(server: EmbeddedNats) -> bool:
    # The monitor endpoint, not the client port: probing the client port would make the server
    # log a protocol error for every probe.
    try:
        url = f"http://{server.host}:{server.monitor_port}/healthz"
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(server: EmbeddedNats, lines: int = 20) -> str:
    try:
        text = (server.store_dir / "nats-server.log").read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def password_variable(role: str) -> str:
    """The environment variable a deployed nats-server (and the role's service) reads ``role``'s password from."""
    return f"DART_NATS_{role.upper()}_PASSWORD"


def deployment_nats_config(run: str, prefix: str = DEFAULT_PREFIX, store_dir: str = "/data") -> str:
    """``deploy/nats/nats.conf``: every role of :data:`~dart.protocol.topology.ROLES` with its permissions for
    ``run``, passwords from :func:`password_variable` (so the file holds no secret)."""
    users: dict[str, Permissions] = {role: service_permissions(role, prefix, run) for role in ROLES}
    return deployment_config(users, {role: password_variable(role) for role in ROLES}, store_dir=store_dir)


def nats_command(
    port: Annotated[
        int, typer.Option("--port", "-p", min=0, max=65535, help="Client port; 0 picks a free one.")
    ] = 4222,
    host: Annotated[str, typer.Option("--host", help="Interface to listen on.")] = "127.0.0.1",
    store_dir: Annotated[
        Path | None,
        typer.Option("--store-dir", help="JetStream storage directory, kept at exit. Default: a temporary one."),
    ] = None,
    users_dir: Annotated[
        Path | None,
        typer.Option("--users-dir", help="Admit only per-service users whose passwords are (or are put) here."),
    ] = None,
    run: Annotated[str, typer.Option("--run", help="Run token the users' permissions are scoped to.")] = "run",
    prefix: Annotated[str, typer.Option("--prefix", help="Subject prefix of the users' permissions.")] = DEFAULT_PREFIX,
    print_config: Annotated[
        bool,
        typer.Option(
            "--print-config",
            help="Print a nats-server config for a deployment instead of serving: every role as a user with its "
            "permissions for --run, each password read by the server from DART_NATS_<ROLE>_PASSWORD.",
        ),
    ] = False,
) -> None:
    """Run a nats-server with JetStream in the foreground until Ctrl-C."""
    if print_config:
        typer.echo(deployment_nats_config(run, prefix), nl=False)
        return
    console = Console(highlight=False, soft_wrap=True)
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    # Installed before the server starts, so a signal during startup still stops it cleanly.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        users = []
        if users_dir is not None:
            files = write_bus_credentials(users_dir, ROLES, directory="", keep_existing=True)
            users = [NatsUser(r, f, service_permissions(r, prefix, run)) for r, f in files.items()]
        exit_code = _serve(console, stop, received, port, host, store_dir, users)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    raise typer.Exit(exit_code)


def _serve(
    console: Console,
    stop: threading.Event,
    received: list[str],
    port: int,
    host: str,
    store_dir: Path | None,
    users: list[NatsUser],
) -> int:
    if port and port_open(host, port):
        console.print(
            f"[red]error:[/] {host}:{port} is already in use; pick another --port, or --port 0 for a free one"
        )
        return 1
    server = EmbeddedNats(port=port or None, host=host, store_dir=store_dir, users=users)
    try:
        server.start()
    except EmbeddedServerError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        server.stop()
        return 1
    started = time.monotonic()
    kept = "kept" if store_dir is not None else "removed at exit"
    console.print(f"NATS with JetStream listening on {server.url}")
    console.print(f"  pid {server.pid}, store {server.store_dir} ({kept}), monitor http://{host}:{server.monitor_port}")
    console.print(f"  use it with: export DART_BUS__URL={server.url}")
    if users:
        console.print(f"  users {', '.join(u.name for u in users)}: DART_BUS__USER / DART_BUS__PASSWORD_FILE")
    console.print("Press Ctrl-C to stop.")
    console.file.flush()
    exit_code, reason = 0, ""
    try:
        while not stop.wait(1.0):
            if not _healthy(server) and not stop.is_set():
                exit_code, reason = 1, "nats-server stopped unexpectedly"
                console.print(f"[red]error:[/] {reason}; last log lines:\n{escape(_log_tail(server))}")
                break
    finally:
        pid = server.pid
        server.stop()
    stopped_by = received[0] if received else reason
    if exit_code == 0:
        console.print(f"stopped ({stopped_by})")
    summary = {
        "url": server.url,
        "pid": pid,
        "stopped_by": stopped_by,
        "uptime_s": round(time.monotonic() - started, 3),
    }
    console.file.write(json.dumps(summary) + "\n")
    console.file.flush()
    return exit_code


def register(app: typer.Typer) -> None:
    """Add ``nats`` to the ``dart`` app."""
    app.command("nats")(nats_command)
