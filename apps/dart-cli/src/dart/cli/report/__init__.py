"""``dart report RUN_DIR``: one self-contained HTML file with the figures and plots of a run.

It reads what ``dart run`` left in the run directory (config, summary, the SQLite trajectory index
and the JSONL telemetry, see :mod:`dart.cli.report.load`), draws the plots
(:mod:`dart.cli.report.plots`) and writes the page (:mod:`dart.cli.report.html`), by default to
``RUN_DIR/report.html``. Missing pieces get a note in their section; the command fails (exit 2)
only when the path is not a run directory. The last stdout line is JSON:
``{"report": PATH, "plots": N}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def report(
    run_dir: Annotated[Path, typer.Argument(help="The run directory `dart run` wrote.", show_default=False)],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Where to write the HTML (default: RUN_DIR/report.html).")
    ] = None,
) -> None:
    """Write an HTML report with plots of a training run."""
    # Imported here: matplotlib is slow to import and `dart --help` must stay fast.
    import matplotlib

    matplotlib.use("Agg")
    from dart.cli.report.html import render_report
    from dart.cli.report.load import NotARunDirError, load_run

    try:
        data = load_run(run_dir)
    except NotARunDirError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    page, plots = render_report(data)
    target = out if out is not None else run_dir / "report.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page, encoding="utf-8")
    typer.echo(str(target))
    typer.echo(json.dumps({"report": str(target), "plots": plots}))


def register(app: typer.Typer) -> None:
    """Add the ``report`` command to ``app``."""
    app.command("report")(report)
