"""The report's plots, drawn with matplotlib's Agg canvas and returned as PNG bytes.

Each ``plot_*`` function takes a :class:`RunData` and returns a :class:`Plot`, or a string saying
why there is nothing to draw (no trainer events, no index, ...); the HTML puts that note where the
plot would be. Figures are built with :class:`matplotlib.figure.Figure` rather than pyplot, so no
global figure state or interactive backend is involved. Times are seconds since the run started.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dart.cli.report.load import Event, RunData
from dart.runtime.telemetry import BusyInterval, utilization_timeline

RESOURCE_KINDS = ("env", "engine", "trainer")
"""Busy resource kinds plotted, in legend order."""

TRAINER_SERIES: tuple[tuple[str, str], ...] = (
    ("loss", "loss"),
    ("clip_fraction", "clip fraction"),
    ("tis_weight_mean", "TIS weight mean"),
    ("tis_truncated_fraction", "TIS truncated fraction"),
    ("rollout_mismatch", "rollout mismatch (nats)"),
    ("entropy", "entropy (nats)"),
    ("grad_norm", "grad norm"),
)
"""``trainer.step`` attributes drawn against the step, with their axis titles."""

_DPI = 100


@dataclass(frozen=True)
class Plot:
    """One rendered figure.

    Attributes:
        title: Caption shown above it.
        png: The PNG image.
    """

    title: str
    png: bytes


def _render(fig: Figure, title: str) -> Plot:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return Plot(title, buf.getvalue())


def _seconds(data: RunData, ts_ns: float) -> float:
    return (ts_ns - (data.start_ns or 0)) / 1e9


def rolling_rate(outcomes: Sequence[bool], window: int) -> list[float]:
    """Trailing mean of ``outcomes`` over at most ``window`` items (shorter at the start)."""
    out: list[float] = []
    total = 0
    for i, ok in enumerate(outcomes):
        total += ok
        if i >= window:
            total -= outcomes[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_success_over_time(data: RunData) -> Plot | str:
    """Rolling success rate of trainable, non-pooled trajectories, by finish time."""
    if not data.trajectories:
        return "No trajectory index (data.sqlite3 missing or empty)."
    items = [t for t in data.trajectories if t.trainable]
    if not items:
        return "No trainable (ok/truncated, not pooled) trajectories."
    window = max(5, min(50, len(items) // 10))
    rates = rolling_rate([t.success for t in items], window)
    xs = [_seconds(data, t.finished_at * 1e9) for t in items]
    fig = Figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    ax.plot(xs, rates, color="tab:blue", lw=1.6, label=f"rolling mean, last {window}")
    ax.scatter(xs, [float(t.success) for t in items], s=6, color="tab:gray", alpha=0.35, label="trajectory")
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return _render(fig, f"Success rate over time ({len(items)} trajectories)")


def plot_success_by_version(data: RunData) -> Plot | str:
    """Success rate and count per ``max_policy_version`` of trainable, non-pooled trajectories."""
    items = [t for t in data.trajectories if t.trainable]
    if not items:
        return "No trainable trajectories in the index."
    by_version: dict[int, list[bool]] = {}
    for t in items:
        by_version.setdefault(t.max_policy_version, []).append(t.success)
    versions = sorted(by_version)
    rates = [sum(by_version[v]) / len(by_version[v]) for v in versions]
    fig = Figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    bars = ax.bar([str(v) for v in versions], rates, color="tab:green")
    for bar, v in zip(bars, versions, strict=True):
        ax.annotate(
            f"n={len(by_version[v])}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xlabel("policy version (newest that acted)")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1.1)
    ax.grid(alpha=0.3, axis="y")
    return _render(fig, "Success rate by policy version")


def heldout_points(data: RunData, event: str = "validation.heldout") -> list[tuple[int, float, float, float, int]]:
    """``(version, success, ci95 low, ci95 high, n)`` of each held-out evaluation (``validation.heldout``
    telemetry events; ``validation.train`` for the training suite's), by version; evaluations with no counted
    episode are left out."""
    points = []
    for e in data.event_list(event):
        a = e.attributes
        if a.get("success") is None:
            continue
        points.append(
            (int(a["version"]), float(a["success"]), float(a["ci95_low"]), float(a["ci95_high"]), int(a["n"]))
        )
    return sorted(points)


def plot_heldout(data: RunData) -> Plot | str:
    """Greedy held-out success per evaluated version, with 95% Wilson intervals; beside it the training
    suite's at the first and the final version, when the run evaluated it (``validation.train_split``)."""
    points = heldout_points(data)
    if not points:
        return "No held-out validation in this run (enable `validation` in the run config)."
    fig = Figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    series = [
        ("held-out", points, "tab:purple"),
        ("train split", heldout_points(data, "validation.train"), "tab:green"),
    ]
    for label, shown, color in series:
        if not shown:
            continue
        versions = [p[0] for p in shown]
        success = [p[1] for p in shown]
        lower = [p[1] - p[2] for p in shown]
        upper = [p[3] - p[1] for p in shown]
        ax.errorbar(versions, success, yerr=[lower, upper], fmt="o-", color=color, capsize=3, label=f"{label}, 95% CI")
        for v, s, n in zip(versions, success, (p[4] for p in shown), strict=True):
            ax.annotate(f"n={n}", (v, s), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.set_xlabel("policy version")
    ax.set_ylabel("greedy success")
    ax.set_ylim(-0.05, 1.1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return _render(fig, "Greedy success by policy version: held-out, and the train split when evaluated")


def kind_timeline(
    intervals: Sequence[BusyInterval], start_ns: int, end_ns: int, bucket_ns: int
) -> list[tuple[int, float]]:
    """Mean busy fraction per bucket over the resources in ``intervals`` (one kind)."""
    by_id: dict[str, list[BusyInterval]] = {}
    for i in intervals:
        by_id.setdefault(i.resource_id, []).append(i)
    lines = [utilization_timeline(items, start_ns, end_ns, bucket_ns) for items in by_id.values()]
    if not lines:
        return []
    return [(lines[0][b][0], sum(line[b][1] for line in lines) / len(lines)) for b in range(len(lines[0]))]


def plot_utilization(data: RunData, buckets: int = 60) -> Plot | str:
    """Busy fraction per time bucket of envs (mean), engines (mean) and the trainer."""
    if not data.busy or data.start_ns is None or data.end_ns is None or data.end_ns <= data.start_ns:
        return "No busy records in telemetry."
    start, end = data.start_ns, data.end_ns
    bucket_ns = max(1, (end - start) // buckets)
    fig = Figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    for kind in (*RESOURCE_KINDS, *sorted(set(data.busy) - set(RESOURCE_KINDS))):
        intervals = data.busy.get(kind)
        if not intervals:
            continue
        n = len({i.resource_id for i in intervals})
        line = kind_timeline(intervals, start, end, bucket_ns)
        label = f"{kind} (mean of {n})" if n > 1 else kind
        ax.step([_seconds(data, t) for t, _ in line], [u for _, u in line], where="post", label=label, lw=1.4)
    ax.set_xlabel(f"time since run start (s); buckets of {bucket_ns / 1e9:.3g} s")
    ax.set_ylabel("busy fraction")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _render(fig, "Utilization over time")


def plot_staleness(data: RunData) -> Plot | str:
    """Histogram of policy lag: ``data.batch`` staleness at batching, ``trainer.step`` lag at training."""
    at_batch = [int(e.attributes["staleness"]) for e in data.event_list("data.batch") if "staleness" in e.attributes]
    at_train = [
        int(e.attributes["max_policy_lag"]) for e in data.event_list("trainer.step") if "max_policy_lag" in e.attributes
    ]
    if not at_batch and not at_train:
        return "No data.batch or trainer.step events with staleness figures."
    hi = max([*at_batch, *at_train, 0])
    bins = [b - 0.5 for b in range(hi + 2)]
    fig = Figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    series = [("when batched (data.batch)", at_batch), ("when trained (trainer.step)", at_train)]
    present = [(label, values) for label, values in series if values]
    ax.hist(
        [v for _, v in present],
        bins=bins,
        label=[f"{label}, n={len(v)}" for label, v in present],
        color=["tab:orange", "tab:purple"][: len(present)],
    )
    ax.set_xlabel("policy lag (versions behind the newest)")
    ax.set_ylabel("batches")
    ax.set_xticks(range(hi + 1))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _render(fig, "Staleness of trained samples")


def plot_training(data: RunData) -> Plot | str:
    """Small multiples of the ``trainer.step`` metrics against the optimizer step."""
    steps = data.event_list("trainer.step")
    series = [(key, label) for key, label in TRAINER_SERIES if any(key in e.attributes for e in steps)]
    if not series:
        return "No trainer.step events (the trainer did not finish a step)."
    cols = 2
    rows = (len(series) + cols - 1) // cols
    fig = Figure(figsize=(8, 2.2 * rows))
    for n, (key, label) in enumerate(series):
        ax = fig.add_subplot(rows, cols, n + 1)
        points = [(_step(e, i), float(e.attributes[key])) for i, e in enumerate(steps) if key in e.attributes]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None, lw=1.2)
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if n >= len(series) - cols:
            ax.set_xlabel("step", fontsize=8)
    return _render(fig, f"Training curves ({len(steps)} steps)")


def _step(event: Event, index: int) -> int:
    value = event.attributes.get("step")
    return int(value) if isinstance(value, int | float) else index + 1


def plot_weight_updates(data: RunData) -> Plot | str:
    """One row per engine with a bar per weight update, and the trainer's publish times.

    Blue: loaded; red: the engine refused it; hatched grey: started and never finished (the run
    ended or crashed mid-update), drawn up to the end of the run.
    """
    ends = data.event_list("engine.update.end")
    starts = data.event_list("engine.update.start")
    if not ends and not starts:
        return "No engine.update events (no weight update reached an engine)."
    base = (data.start_ns or 0) / 1e9
    run_end = (data.end_ns or 0) / 1e9 - base
    finished = {(_engine(e), e.attributes.get("version")) for e in ends}
    engines = sorted({_engine(e) for e in (*ends, *starts)})
    rows = {engine: n for n, engine in enumerate(engines)}
    fig = Figure(figsize=(8, max(1.8, 0.5 * len(engines) + 1.2)))
    ax = fig.add_subplot()
    for e in ends:
        start = float(e.attributes.get("started_at", e.ts_ns / 1e9)) - base
        stop = float(e.attributes.get("ts", e.ts_ns / 1e9)) - base
        color = "tab:blue" if e.attributes.get("ok", True) else "tab:red"
        _update_bar(ax, rows[_engine(e)], start, stop, e.attributes.get("version"), color=color)
    for e in starts:
        if (_engine(e), e.attributes.get("version")) not in finished:
            start = float(e.attributes.get("ts", e.ts_ns / 1e9)) - base
            _update_bar(ax, rows[_engine(e)], start, max(run_end, start), e.attributes.get("version"), hatch="//")
    published = data.event_list("trainer.published")
    for i, pub in enumerate(published):
        ax.axvline(_seconds(data, pub.ts_ns), color="tab:gray", ls=":", lw=0.8, label="published" if i == 0 else None)
    ax.set_yticks(range(len(engines)), engines, fontsize=8)
    ax.set_ylim(-0.7, len(engines) - 0.3)
    ax.set_xlabel("time since run start (s)")
    ax.grid(alpha=0.3, axis="x")
    if published:
        ax.legend(fontsize=8, loc="upper left")
    return _render(fig, f"Engine weight updates ({len(ends)} finished)")


def _engine(event: Event) -> str:
    return str(event.attributes.get("engine_id", "?"))


def _update_bar(
    ax: Axes, row: int, start: float, stop: float, version: object, *, color: str = "tab:gray", hatch: str | None = None
) -> None:
    ax.broken_barh([(start, max(stop - start, 1e-3))], (row - 0.35, 0.7), color=color, hatch=hatch, alpha=0.9)
    ax.annotate(f"v{version}", (stop, row + 0.4), fontsize=6, ha="right")
