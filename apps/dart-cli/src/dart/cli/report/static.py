"""A static report: the viewer's pages written to one directory, readable with no server.

What it writes (every link relative, so the directory can be moved, zipped or served as it is)::

    index.html                 the overview, with the plots of a run directory's telemetry
    trajectories.html          the rendered trajectories (the newest ``count``), in id order
    trajectory-<id>.html       each of them, step by step
    group-<id>.html            the groups they belong to
    images/<key>               every screenshot those pages show, copied from the store
    plots/<n>.png              the plots
    view.css

It renders through :class:`~dart.cli.view.app.Viewer` with :class:`~dart.cli.view.links.StaticLinks`, so a
report and the viewer show the same pages; links to pages it did not render (a filtered list, a
trajectory outside the rendered set) are left as text.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dart.cli.report import plots
from dart.cli.report.load import RunData, load_run
from dart.cli.view.app import open_viewer
from dart.cli.view.errors import PageError
from dart.cli.view.links import StaticLinks, group_file, image_file, trajectory_file
from dart.cli.view.queries import Page
from dart.cli.view.render import STYLESHEET
from dart.cli.view.source import RunSource

PLOTS: tuple[tuple[str, Sequence[Callable[[RunData], plots.Plot | str]]], ...] = (
    ("Success rate", (plots.plot_success_over_time, plots.plot_success_by_version)),
    ("Held-out validation", (plots.plot_heldout,)),
    ("Utilization", (plots.plot_utilization,)),
    ("Staleness", (plots.plot_staleness,)),
    ("Training", (plots.plot_training,)),
    ("Weight updates", (plots.plot_weight_updates,)),
)
"""The plots of a run directory, by section, in page order."""


@dataclass(frozen=True)
class Written:
    """What :func:`write_report` wrote.

    Attributes:
        index: The overview page.
        pages: HTML pages written.
        images: Images copied from the store.
        plots: Plots drawn.
        missing_images: Images a page linked to that the store no longer had (each page says so).
    """

    index: Path
    pages: int
    images: int
    plots: int
    missing_images: int


def write_report(source: RunSource, out: Path, count: int) -> Written:
    """Write the report of ``source`` into ``out`` (created; an earlier report there is replaced).

    Raises:
        NotARunError: The index is missing or not one this code reads.
    """
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("trajectory-*.html"), *out.glob("group-*.html")]:
        stale.unlink()
    for folder in ("images", "plots"):
        shutil.rmtree(out / folder, ignore_errors=True)
    link = StaticLinks(set(), set())
    viewer = open_viewer(source, link)
    try:
        rows = viewer.index.newest(count)
        link.trajectory_ids.update(r["trajectory_id"] for r in rows)
        link.group_ids.update(r["group_id"] for r in rows)
        figures = _write_plots(source, out)
        pages = {"index.html": viewer.overview_page(plots=figures)}
        total = viewer.index.overview().total
        pages["trajectories.html"] = viewer.list_page({}, Page(rows, total, None, None))
        for trajectory_id in sorted(link.trajectory_ids):
            pages[trajectory_file(trajectory_id)] = viewer.trajectory_page(trajectory_id)[0]
        for group_id in sorted(link.group_ids):
            pages[group_file(group_id)] = viewer.group_page(group_id)
        for name, html in pages.items():
            (out / name).write_text(html, encoding="utf-8")
        shutil.copyfile(STYLESHEET, out / "view.css")
        copied, missing = 0, 0
        (out / "images").mkdir(exist_ok=True)
        for key in sorted(link.images):
            try:
                data, _ = viewer.artifacts.image(key)
            except PageError:
                missing += 1  # deleted since its page was rendered: the browser shows a broken image
                continue
            (out / image_file(key)).write_bytes(data)
            copied += 1
    finally:
        viewer.close()
    drawn = sum(1 for _, src, _ in figures if src)
    return Written(out / "index.html", len(pages), copied, drawn, missing)


def _write_plots(source: RunSource, out: Path) -> list[tuple[str, str | None, str]]:
    """Draw a run directory's plots into ``out/plots``: ``(title, relative path or None, note)`` each."""
    if source.run_dir is None:
        return [("Plots", None, "drawn from a run directory's telemetry and index; a deployment's report has none")]
    data = load_run(source.run_dir)
    (out / "plots").mkdir(exist_ok=True)
    figures: list[tuple[str, str | None, str]] = []
    for section, plotters in PLOTS:
        for plotter in plotters:
            result = plotter(data)
            if isinstance(result, plots.Plot):
                name = f"plots/{len(figures):02d}.png"
                (out / name).write_bytes(result.png)
                figures.append((result.title, name, ""))
            else:
                figures.append((section, None, result))
    return figures
