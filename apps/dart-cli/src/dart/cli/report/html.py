"""The report page: headline figures, the run config and the plots, in one self-contained HTML file.

Plots are embedded as base64 PNG ``<img>`` tags and the style sheet is inline, so the file can be
mailed or attached to an issue and opened anywhere with no other file beside it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

import yaml

import dart.cli.report.plots as plots
from dart.cli.report.load import RunData
from dart.protocol.telemetry import utilization

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; margin-top: 2em; }
table { border-collapse: collapse; } td, th { padding: 0.2em 0.8em; border-bottom: 1px solid #eee; text-align: left; }
th { font-weight: 600; } pre { background: #f6f8fa; padding: 1em; overflow-x: auto; font-size: 0.85em; }
figure { margin: 1em 0; } figcaption { font-weight: 600; margin-bottom: 0.3em; } img { max-width: 100%; }
.note { color: #8a6d3b; background: #fcf8e3; padding: 0.5em 1em; }
"""


@dataclass(frozen=True)
class Section:
    """One titled part of the report.

    Attributes:
        title: Heading.
        plotters: Functions drawing its plots (each a :class:`plots.Plot` or a note).
    """

    title: str
    plotters: Sequence[Callable[[RunData], plots.Plot | str]]


SECTIONS: tuple[Section, ...] = (
    Section("Success rate", (plots.plot_success_over_time, plots.plot_success_by_version)),
    Section("Held-out validation", (plots.plot_heldout,)),
    Section("Utilization", (plots.plot_utilization,)),
    Section("Staleness", (plots.plot_staleness,)),
    Section("Training", (plots.plot_training,)),
    Section("Weight updates", (plots.plot_weight_updates,)),
)
"""Plot sections in page order (after the summary and configuration)."""


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _rate(outcomes: Sequence[bool]) -> float | None:
    return sum(outcomes) / len(outcomes) if outcomes else None


def headline_figures(data: RunData) -> list[tuple[str, str]]:
    """The summary table's ``(label, value)`` rows, computed from telemetry and the index."""
    rows: list[tuple[str, str]] = [("run directory", str(data.run_dir))]
    rows.append(("wall time", f"{data.duration_s:.1f} s" if data.start_ns is not None else "n/a"))
    published = data.event_list("trainer.published")
    versions = [int(e.attributes["version"]) for e in published if "version" in e.attributes]
    rows.append(("versions published", f"{len(published)}" + (f" (latest v{max(versions)})" if versions else "")))
    if published:  # what a version is: full weights, or a LoRA run's adapter over its base
        last = published[-1].attributes
        kind = str(last.get("kind", "weights"))
        if "adapter_rank" in last:
            kind += f" (rank {last['adapter_rank']})"
        size = f"; the last is {int(last['bytes']):,} bytes" if "bytes" in last else ""
        rows.append(("a version is", kind + size))
    rows.append(("trainer steps", str(len(data.event_list("trainer.step")))))

    stats = data.event_list("data.stats")
    last = stats[-1].attributes if stats else {}
    statuses: dict[str, int] = {}
    for t in data.trajectories:
        statuses[t.status] = statuses.get(t.status, 0) + 1
    produced = last.get("received", len(data.trajectories)) - last.get("duplicates", 0)
    rows.append(("trajectories produced", str(produced)))
    rows.append(("trajectories stored", str(last.get("stored", len(data.trajectories)))))
    lost = statuses.get("aborted", 0) + statuses.get("failed", 0)
    rows.append(("trajectories lost (aborted/failed)", str(lost)))
    if statuses:
        rows.append(("by status", ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))))
    drops = last.get("drops")
    if isinstance(drops, dict) and drops:
        rows.append(("dropped by the data manager", ", ".join(f"{k}: {v}" for k, v in sorted(drops.items()))))
    pooled = sum(t.pooled for t in data.trajectories)
    if pooled:
        rows.append(("pooled (experience pool)", str(pooled)))

    trainable = [t.success for t in data.trajectories if t.trainable]
    quarter = max(1, len(trainable) // 4)
    rows.append(("success, first quarter", _pct(_rate(trainable[:quarter]))))
    rows.append(("success, last quarter", _pct(_rate(trainable[-quarter:]))))
    rows.append(("success, all", _pct(_rate(trainable))))
    heldout = plots.heldout_points(data)
    if heldout:
        first, final = heldout[0], heldout[-1]
        rows.append(
            (
                "held-out success (greedy)",
                f"v{first[0]} {_pct(first[1])} [{first[2]:.0%}, {first[3]:.0%}] -> "
                f"v{final[0]} {_pct(final[1])} [{final[2]:.0%}, {final[3]:.0%}] (n={final[4]})",
            )
        )

    if data.start_ns is not None and data.end_ns is not None:
        for kind in plots.RESOURCE_KINDS:
            intervals = data.busy.get(kind, [])
            ids = sorted({i.resource_id for i in intervals})
            per = [utilization([i for i in intervals if i.resource_id == r], data.start_ns, data.end_ns) for r in ids]
            value = f"{sum(per) / len(per):.1%} (mean of {len(per)})" if per else "n/a"
            rows.append((f"{kind} utilization", value))
    return rows


def _table(rows: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _summary_json_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    return [(str(k), v if isinstance(v, str) else json.dumps(v, sort_keys=True)) for k, v in summary.items()]


def _config_block(data: RunData) -> str:
    if data.config is not None:
        text = yaml.safe_dump(dict(data.config), sort_keys=False, default_flow_style=False, allow_unicode=True)
    elif data.config_text:
        text = data.config_text
    else:
        return '<p class="note">No config.yaml in the run directory.</p>'
    return f"<pre>{escape(text)}</pre>"


def _figure(plot: plots.Plot) -> str:
    encoded = base64.b64encode(plot.png).decode("ascii")
    return (
        f'<figure><figcaption>{escape(plot.title)}</figcaption><img alt="{escape(plot.title)}" '
        f'src="data:image/png;base64,{encoded}"></figure>'
    )


def render_report(data: RunData) -> tuple[str, int]:
    """The report page for ``data``.

    Returns:
        ``(html, plots)``: the page and how many plots it embeds.
    """
    title = f"DART run report: {data.run_dir.name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        "<h2>Summary</h2>",
        _table(headline_figures(data)),
    ]
    if data.summary is not None:
        parts += ["<h3>summary.json</h3>", _table(_summary_json_rows(dict(data.summary)))]
    if data.problems:
        items = "".join(f"<li>{escape(p)}</li>" for p in data.problems)
        parts.append(f'<div class="note">Missing pieces:<ul>{items}</ul></div>')
    parts += ["<h2>Configuration</h2>", _config_block(data)]
    count = 0
    for section in SECTIONS:
        parts.append(f"<h2>{escape(section.title)}</h2>")
        for plotter in section.plotters:
            result = plotter(data)
            if isinstance(result, plots.Plot):
                parts.append(_figure(result))
                count += 1
            else:
                parts.append(f'<p class="note">{escape(result)}</p>')
    parts.append("</body></html>")
    return "\n".join(parts), count
