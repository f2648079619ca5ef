"""``dart env``: inspect environment task sets (``osworld-audit``: what of OSWorld a provider's VMs run)."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from dart.env.osworld.audit import AuditReport

env_app = typer.Typer(help="Inspect environment task sets.", no_args_is_help=True)


class AuditProvider(StrEnum):
    """What ``osworld-audit`` audits against: this host's local desktop, or OSWorld's VM image."""

    LOCAL = "local"
    DOCKER = "docker"
    REMOTE = "remote"


_KIND_TITLES = {"step": "Setup steps", "getter": "Evaluator getters", "metric": "Metrics", "app": "Apps and programs"}


@env_app.command("osworld-audit")
def osworld_audit(
    directory: Annotated[
        Path, typer.Argument(help="OSWorld task directory: holds examples/<domain>/<id>.json (or is examples/).")
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Also print the report as one JSON object (last line).")
    ] = False,
    network: Annotated[
        bool, typer.Option(help="Count download steps and cloud files as supported (the VMs reach the internet).")
    ] = False,
    provider: Annotated[
        AuditProvider,
        typer.Option(
            help="Whose VMs: local (this host's desktop, probed here), docker or remote (OSWorld's VM image, "
            "with every application its tasks use)."
        ),
    ] = AuditProvider.LOCAL,
) -> None:
    """Parse every OSWorld task and report which a provider's VMs can run, and why the rest cannot."""
    from dart.env.osworld.audit import audit_dir
    from dart.env.osworld.errors import OSWorldTaskError
    from dart.env.osworld.support import audit_platform

    console = Console(highlight=False)
    try:
        report = audit_dir(directory, audit_platform(provider.value, network=network))
    except OSWorldTaskError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(1) from None
    render(report, console)
    if as_json:
        typer.echo(json.dumps(report.to_json()))


def render(report: AuditReport, console: Console) -> None:
    """Print the audit as rich tables: one per kind, then totals by domain."""
    for kind, title in _KIND_TITLES.items():
        table = Table(title=title, title_justify="left")
        for column, justify in (("name", "left"), ("tasks", "right"), ("uses", "right"), ("ok", "center")):
            table.add_column(column, justify=justify)  # type: ignore[arg-type]  # rich's JustifyMethod literal
        table.add_column("reason", overflow="fold")
        for u in report.of_kind(kind):
            mark = "[green]yes[/]" if u.supported else "[red]no[/]"
            table.add_row(escape(u.name), str(u.tasks), str(u.uses), mark, escape(u.reason))
        console.print(table)
    table = Table(title="Tasks by domain", title_justify="left")
    for column in ("domain", "tasks", "runnable"):
        table.add_column(column, justify="left" if column == "domain" else "right")
    runnable = report.runnable_ids()
    for domain, ids in runnable.items():
        table.add_row(domain, str(sum(t.domain == domain for t in report.tasks)), str(len(ids)))
    table.add_row("[bold]total[/]", str(report.total), str(len(report.runnable)))
    console.print(table)
    console.print(
        f"parsed {report.total} task(s) from {escape(report.root)}; "
        f"[bold]{len(report.runnable)}[/] runnable on "
        f"{'the local desktop' if report.platform == 'local' else 'the OSWorld VM image'}"
        f"{'' if report.network else ' (no network)'}"
    )


def register(app: typer.Typer) -> None:
    """Add ``dart env`` to the CLI."""
    app.add_typer(env_app, name="env")
