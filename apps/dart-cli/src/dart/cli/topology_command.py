"""``dart topology --config RUN_CONFIG``: create (or confirm) a run's streams, consumers and state bucket.

A deployment runs it once as the ``run`` user before the services start (the compose stack's
``topology`` service): the services' own NATS users may only find the topology, not create or change it
(:mod:`dart.protocol.topology`). ``dart run`` does the same itself. It reads the run config's ``run`` and
``bus`` sections (environment overrides apply, e.g. ``DART_BUS__USER=run``), prints one JSON line
naming what exists, and exits 0; 1 when the server refused or could not be reached, 2 on a bad config.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer


async def _create(config: Any) -> dict[str, Any]:
    from dart.protocol.topology import STREAMS
    from dart.runtime.bus import Bus
    from dart.runtime.topology import durable_name, ensure_topology

    bus_config = config.bus.model_copy(update={"run": config.run.name, "name": "dart-topology"})
    async with await Bus.connect(bus_config) as bus:
        state = await ensure_topology(bus)
        return {
            "run": config.run.name,
            "streams": [bus.subjects.stream_name(kind) for kind in STREAMS],
            "consumers": [durable_name(bus, kind) for kind, spec in STREAMS.items() if spec.consumer is not None],
            "bucket": state.bucket,
        }


def topology_command(
    config_path: Annotated[Path, typer.Option("--config", "-c", help="Run config YAML.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(metavar="KEY=VALUE", help="Settings over the file's.")
    ] = None,
) -> None:
    """Create (or confirm) the run's NATS streams, consumers and state bucket, as the config's bus user."""
    from dart.protocol.errors import BusError, ConfigError
    from dart.runtime.serving import ServeConfig, load_serve_config

    try:
        config = load_serve_config(ServeConfig, config_path, overrides or ())
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        created = asyncio.run(_create(config))
    except BusError as exc:
        typer.echo(f"error: dart topology failed: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(created))


def register(app: typer.Typer) -> None:
    """Add ``dart topology``."""
    app.command("topology")(topology_command)
