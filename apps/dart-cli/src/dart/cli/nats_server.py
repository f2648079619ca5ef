"""``dart nats``: an embedded nats-server with JetStream in the foreground, for development.

Lifecycle: start (prints the URL) -> serve until SIGINT/SIGTERM (exit 0) or until the server
dies (exit 1, with the tail of its log) -> stop the server and remove a temporary store. The last
line printed is a JSON summary.

With ``--print-config --run NAME`` it prints the config a deployment's nats-server uses instead
(``deploy/nats/nats.conf``: the same users, passwords from ``DART_NATS_<ROLE>_PASSWORD`` variables).

With ``--cluster N`` it runs N servers routed into one JetStream cluster and prints every URL; services
given all of them, with ``bus.replicas: 3``, ride out the loss of one node.

With ``--users-dir DIR --run NAME`` the server admits only DART's per-service users, each limited to
its subjects for that run (``dart.protocol.permissions``); passwords are created in ``DIR`` (0600) on
first use and kept, so ``dart serve`` processes connect with ``DART_BUS__USER=<role>`` and
``DART_BUS__PASSWORD_FILE=DIR/nats-<role>.password``.
"""

from __future__ import annotations

import json
import shlex
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from dart.cli.stack.secrets import write_bus_credentials
from dart.embedded.nats import EmbeddedNats, EmbeddedNatsCluster, NatsUser, deployment_config
from dart.embedded.process import EmbeddedServerError, port_open
from dart.protocol.permissions import Permissions, service_permissions
from dart.protocol.subjects import DEFAULT_PREFIX
from dart.protocol.topology import ROLES


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
    cluster: Annotated[
        int,
        typer.Option(
            "--cluster",
            min=1,
            max=9,
            help="Run this many servers routed into one JetStream cluster (ports --port, --port+1, ...; free ones "
            "with --port 0); give clients every URL and set bus.replicas (3 survives the loss of a node).",
        ),
    ] = 1,
) -> None:
    """Run a nats-server with JetStream (or a cluster of them) in the foreground until Ctrl-C."""
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
        exit_code = _serve(console, stop, received, port, host, store_dir, users, cluster)
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
    size: int,
) -> int:
    ports = [port + i for i in range(size)] if port else []
    busy = [p for p in ports if port_open(host, p)]
    if busy:
        console.print(
            f"[red]error:[/] {host}:{busy[0]} is already in use; pick another --port, or --port 0 for free ones"
        )
        return 1
    servers: EmbeddedNats | EmbeddedNatsCluster
    if size == 1:
        servers = EmbeddedNats(port=port or None, host=host, store_dir=store_dir, users=users)
        nodes = [servers]
    else:
        servers = EmbeddedNatsCluster(size, host=host, store_dir=store_dir, users=users, ports=ports or None)
        nodes = servers.nodes
    try:
        servers.start()
    except EmbeddedServerError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        servers.stop()
        return 1
    started = time.monotonic()
    kept = "kept" if store_dir is not None else "removed at exit"
    urls = [node.url for node in nodes]
    if size == 1:
        console.print(f"NATS with JetStream listening on {urls[0]}")
    else:
        console.print(f"NATS JetStream cluster of {size} listening on {', '.join(urls)}")
    for node in nodes:
        console.print(f"  pid {node.pid}, store {node.store_dir} ({kept}), monitor http://{host}:{node.monitor_port}")
    console.print(f"  use it with: export DART_BUS__URL={urls[0] if size == 1 else shlex.quote(json.dumps(urls))}")
    if size > 1:
        console.print(f"  and DART_BUS__REPLICAS={min(size, 3)} (streams and buckets on that many nodes)")
    if users:
        console.print(f"  users {', '.join(u.name for u in users)}: DART_BUS__USER / DART_BUS__PASSWORD_FILE")
    console.print("Press Ctrl-C to stop.")
    console.file.flush()
    exit_code, reason = 0, ""
    pids = [node.pid for node in nodes]
    try:
        while not stop.wait(1.0):
            # A cluster's node is watched by its process (its health flaps while peers elect leaders).
            down = [n for n in nodes if (n.poll() is not None if size > 1 else not n.healthy())]
            if down and not stop.is_set():
                which = f" {down[0].server_name}" if size > 1 else ""
                exit_code, reason = 1, f"nats-server{which} stopped unexpectedly"
                console.print(f"[red]error:[/] {reason}; last log lines:\n{escape(down[0].log_tail())}")
                break
    finally:
        servers.stop()
    stopped_by = received[0] if received else reason
    if exit_code == 0:
        console.print(f"stopped ({stopped_by})")
    summary: dict[str, object] = {"url": urls[0], "pid": pids[0]} if size == 1 else {"urls": urls, "pids": pids}
    summary |= {"stopped_by": stopped_by, "uptime_s": round(time.monotonic() - started, 3)}
    console.file.write(json.dumps(summary) + "\n")
    console.file.flush()
    return exit_code


def register(app: typer.Typer) -> None:
    """Add ``nats`` to the ``dart`` app."""
    app.command("nats")(nats_command)
