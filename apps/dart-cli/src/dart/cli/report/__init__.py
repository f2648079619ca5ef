"""``dart report RUN_DIR`` / ``dart report --config FILE --out DIR``: the viewer's pages as static files.

It opens the run as ``dart view`` does (:func:`dart.cli.view.source.open_run`: a run directory, its
embedded S3 server started again when it has one, or a deployment's index and store) and writes the
overview, the newest ``--trajectories`` trajectories step by step, their groups and their screenshots to
one directory (:mod:`dart.cli.report.static`), by default ``RUN_DIR/report``; a run directory's overview
also gets the plots of its telemetry (:mod:`dart.cli.report.plots`). It prints the overview's path, and
as the last line JSON: ``{"report": PATH, "pages": N, "images": N, "plots": N, "missing_images": N}``.
Exit code 2 when the path is not a run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dart.cli.view import ConfigOption, RunDirArgument, TelemetryOption


def report(
    run_dir: RunDirArgument = None,
    config: ConfigOption = None,
    telemetry: TelemetryOption = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Directory to write (default: RUN_DIR/report).")
    ] = None,
    trajectories: Annotated[
        int, typer.Option("--trajectories", min=0, help="How many of the newest trajectories to render.")
    ] = 50,
) -> None:
    """Write a run's overview, plots and newest trajectories as static HTML pages."""
    # Imported here: matplotlib is slow to import and `dart --help` must stay fast.
    import matplotlib

    matplotlib.use("Agg")
    from dart.cli.report.static import write_report
    from dart.cli.view.errors import NotARunError
    from dart.cli.view.source import open_run

    if out is None and run_dir is None:
        typer.echo("error: give --out DIR with --config (a deployment has no run directory to write into)", err=True)
        raise typer.Exit(2)
    target = out if out is not None else Path(run_dir or ".") / "report"
    try:
        with open_run(run_dir, config, telemetry) as source:
            written = write_report(source, target, trajectories)
    except NotARunError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(str(written.index))
    typer.echo(
        json.dumps(
            {
                "report": str(written.index),
                "pages": written.pages,
                "images": written.images,
                "plots": written.plots,
                "missing_images": written.missing_images,
            }
        )
    )


def register(app: typer.Typer) -> None:
    """Add the ``report`` command to ``app``."""
    app.command("report")(report)
