"""Experiment trackers: the numbers researchers watch, in TensorBoard, Weights & Biases or MLflow.

Every service already writes structured telemetry events (``trainer.step``, ``data.stats``,
``engine.update.end`` ...). A tracker receives the numeric attributes of the events it tracks, as
scalars tagged ``<event>/<attribute>`` (``trainer.step/loss``, ``data.batch/max_staleness``), so
training and rollout curves appear where researchers look, live, and without a network:

- ``tensorboard``: event files under ``<run_dir>/tensorboard/<service>/`` (``tensorboardX``), read by
  ``tensorboard --logdir <run_dir>/tensorboard``.
- ``wandb``: a W&B run per service, grouped by run id; ``mode: offline`` (the default) writes it
  locally for a later ``wandb sync``.
- ``mlflow``: an MLflow run per service in ``tracking_uri`` (a local SQLite store by default).

Each is an optional extra of dart-runtime (``dart-runtime[tensorboard]``, ``[wandb]``, ``[mlflow]``);
a configured tracker whose package is missing fails at service start with the package to install.

The step of a scalar is the event's own ``step`` attribute (optimizer steps for ``trainer.step``), else
its ``version``, else a per-event counter; the wall time is the event's.

Lifecycle: opened by :func:`~dart.runtime.telemetry.setup_telemetry` from
``TelemetryConfig.trackers`` -> fed by :meth:`Telemetry.event` -> flushed and closed by
:meth:`Telemetry.shutdown`.
"""

from __future__ import annotations

import abc
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from dart.protocol.config import ConfigModel
from dart.protocol.errors import ConfigError

_log = logging.getLogger("dart.telemetry.trackers")

DEFAULT_TRACKED_EVENTS = (
    "trainer.step",
    "trainer.published",
    "data.stats",
    "data.batch",
    "data.rejected",
    "engine.update.end",
    "gpu.sample",
    "eval.",
    "validation.",
)
"""Event names (an entry ending in ``.`` is a prefix) whose numbers go to trackers by default."""


class TensorBoardTrackerConfig(ConfigModel):
    """TensorBoard event files."""

    kind: Literal["tensorboard"] = "tensorboard"
    log_dir: Path | None = None
    """Directory of this run's event files (a subdirectory per service); default ``<run_dir>/tensorboard``."""
    flush_interval_s: float = Field(default=5.0, gt=0)
    """How often buffered scalars are written to disk, seconds."""


class WandbTrackerConfig(ConfigModel):
    """A Weights & Biases run per service, grouped by the DART run id."""

    kind: Literal["wandb"] = "wandb"
    project: str = "dart"
    entity: str | None = None
    mode: Literal["offline", "online"] = "offline"
    """``offline`` writes the run locally (no network); ``online`` needs ``WANDB_API_KEY`` in the environment."""
    dir: Path | None = None
    """Where W&B writes its files; default ``<run_dir>``."""


class MlflowTrackerConfig(ConfigModel):
    """An MLflow run per service."""

    kind: Literal["mlflow"] = "mlflow"
    tracking_uri: str | None = None
    """MLflow tracking URI; default a SQLite store ``sqlite:///<run_dir>/mlflow.db`` (MLflow's file store is
    deprecated). Credentials of a tracking server come from MLflow's own environment variables, never
    from here."""
    experiment: str = "dart"


TrackerConfig = Annotated[
    TensorBoardTrackerConfig | WandbTrackerConfig | MlflowTrackerConfig, Field(discriminator="kind")
]
"""One tracker, chosen by ``kind``."""


class Tracker(abc.ABC):
    """Receives scalars; implementations write them to one tracking backend."""

    @abc.abstractmethod
    def log(self, scalars: Mapping[str, float], *, step: int, wall_time: float) -> None:
        """Record ``scalars`` (tag -> value) at ``step``; ``wall_time`` is Unix seconds."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release the backend."""


def _import(module: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            "telemetry config",
            "telemetry.trackers",
            f"a tracker of kind {extra!r} needs {module!r}, which is not installed: "
            f"install 'dart-runtime[{extra}]' or remove the tracker",
        ) from exc


class TensorBoardTracker(Tracker):
    """Scalars into TensorBoard event files (``tensorboardX``, no TensorFlow)."""

    def __init__(self, log_dir: Path, flush_interval_s: float = 5.0) -> None:
        tbx = _import("tensorboardX", "tensorboard")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer = tbx.SummaryWriter(logdir=str(log_dir), flush_secs=max(1, round(flush_interval_s)))

    def log(self, scalars: Mapping[str, float], *, step: int, wall_time: float) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step, walltime=wall_time)

    def close(self) -> None:
        self._writer.close()


class WandbTracker(Tracker):
    """Scalars into a W&B run (``wandb``); offline by default."""

    def __init__(self, config: WandbTrackerConfig, *, run_id: str, service: str, directory: Path) -> None:
        wandb = _import("wandb", "wandb")
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=config.project,
            entity=config.entity,
            mode=config.mode,
            dir=str(directory),
            name=f"{run_id}-{service}",
            group=run_id,
            job_type=service,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def log(self, scalars: Mapping[str, float], *, step: int, wall_time: float) -> None:
        # W&B's own step must increase across all keys of a run; events have steps of their own, so the
        # event's step travels as a scalar beside its values.
        prefixes = {tag.split("/", 1)[0] for tag in scalars}
        self._run.log({**scalars, **{f"{p}/step": step for p in prefixes}})

    def close(self) -> None:
        self._run.finish()


class MlflowTracker(Tracker):
    """Scalars into an MLflow run (``mlflow-skinny``)."""

    def __init__(self, config: MlflowTrackerConfig, *, run_id: str, service: str, tracking_uri: str) -> None:
        tracking = _import("mlflow.tracking", "mlflow")
        entities = _import("mlflow.entities", "mlflow")
        self._metric = entities.Metric
        self._client = tracking.MlflowClient(tracking_uri=tracking_uri)
        experiment = self._client.get_experiment_by_name(config.experiment)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self._client.create_experiment(config.experiment)
        )
        run = self._client.create_run(
            experiment_id, run_name=f"{run_id}-{service}", tags={"dart.run_id": run_id, "dart.service": service}
        )
        self.run_id = run.info.run_id

    def log(self, scalars: Mapping[str, float], *, step: int, wall_time: float) -> None:
        ms = int(wall_time * 1000)
        self._client.log_batch(self.run_id, metrics=[self._metric(k, v, ms, step) for k, v in scalars.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def numeric_attributes(attrs: Mapping[str, Any]) -> dict[str, float]:
    """The finite int/float attributes of an event (booleans, strings, lists and dicts left out)."""
    out = {}
    for key, value in attrs.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


class EventFilter:
    """Which event names are tracked: exact names, and prefixes written with a trailing ``.``."""

    def __init__(self, tracked_events: Sequence[str] = DEFAULT_TRACKED_EVENTS) -> None:
        self._exact = {e for e in tracked_events if not e.endswith(".")}
        self._prefixes = tuple(e for e in tracked_events if e.endswith("."))

    def __call__(self, name: str) -> bool:
        return name in self._exact or name.startswith(self._prefixes)


class TrackerSet:
    """The trackers of one service, fed with events; see the module docstring.

    Thread-safe: events come from the event loop and from worker threads.

    Args:
        trackers: Open trackers.
        tracked_events: Event names to forward (an entry ending in ``.`` matches a prefix).
    """

    def __init__(self, trackers: Sequence[Tracker], tracked_events: Sequence[str] = DEFAULT_TRACKED_EVENTS) -> None:
        self.trackers = list(trackers)
        self.tracks = EventFilter(tracked_events)
        """Whether events of a name are forwarded."""
        self._counters: defaultdict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._closed = False

    def record(self, name: str, attrs: Mapping[str, Any], *, wall_time: float | None = None) -> None:
        """Forward the numbers of one event; a failing tracker is logged, never raised to the service."""
        if not self.trackers or not self.tracks(name):
            return
        values = numeric_attributes(attrs)
        if not values:
            return
        with self._lock:
            if self._closed:
                return
            step_attr = attrs.get("step", attrs.get("version"))
            if isinstance(step_attr, int) and not isinstance(step_attr, bool):
                step = step_attr
            else:
                step = self._counters[name]
                self._counters[name] += 1
            scalars = {f"{name}/{key}": value for key, value in values.items()}
            when = wall_time if wall_time is not None else time.time()
            for tracker in self.trackers:
                try:
                    tracker.log(scalars, step=step, wall_time=when)
                except Exception:  # a tracker must never take the service down
                    _log.exception("tracker %s failed to log %s", type(tracker).__name__, name)

    def close(self) -> None:
        """Flush and close every tracker. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:
                _log.exception("tracker %s failed to close", type(tracker).__name__)


def open_trackers(
    configs: Sequence[TensorBoardTrackerConfig | WandbTrackerConfig | MlflowTrackerConfig],
    *,
    run_dir: Path,
    run_id: str,
    service: str,
    tracked_events: Sequence[str] = DEFAULT_TRACKED_EVENTS,
) -> TrackerSet:
    """Open the configured trackers of one service.

    Raises:
        ConfigError: A tracker's package is not installed.
    """
    trackers: list[Tracker] = []
    try:
        for config in configs:
            if isinstance(config, TensorBoardTrackerConfig):
                root = config.log_dir if config.log_dir is not None else run_dir / "tensorboard"
                trackers.append(TensorBoardTracker(root / service, config.flush_interval_s))
            elif isinstance(config, WandbTrackerConfig):
                directory = config.dir if config.dir is not None else run_dir
                trackers.append(WandbTracker(config, run_id=run_id, service=service, directory=directory))
            else:
                uri = config.tracking_uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
                trackers.append(MlflowTracker(config, run_id=run_id, service=service, tracking_uri=uri))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return TrackerSet(trackers, tracked_events)
