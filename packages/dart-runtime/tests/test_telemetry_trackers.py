"""Experiment trackers fed from telemetry events: TensorBoard files, an MLflow file store, an offline W&B run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dart.protocol.errors import ConfigError
from dart.runtime.telemetry import TelemetryConfig, setup_telemetry
from dart.runtime.telemetry.trackers import (
    MlflowTrackerConfig,
    TensorBoardTrackerConfig,
    TrackerSet,
    WandbTrackerConfig,
    numeric_attributes,
    open_trackers,
)

pytestmark = pytest.mark.unit


def _emit(run_dir: Path, trackers: list[object]) -> None:
    config = TelemetryConfig.model_validate({"run_dir": run_dir, "trackers": trackers})
    telemetry = setup_telemetry("dart-train", version="0", run_id="r1", config=config)
    try:
        for step, loss in ((1, 0.5), (2, 0.25), (3, 0.125)):
            telemetry.event("trainer.step", step=step, loss=loss, clip_fraction=0.1 * step, batch_id="b", ok=True)
        telemetry.event("data.stats", stored=7, task_success={"t": 0.5})
        telemetry.event("trajectory.done", reward=1.0)  # not tracked by default
    finally:
        telemetry.shutdown()


def test_tensorboard_event_files_load_with_the_expected_tags(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _emit(tmp_path, [{"kind": "tensorboard"}])
    log_dir = tmp_path / "tensorboard" / "dart-train"
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"trainer.step/step", "trainer.step/loss", "trainer.step/clip_fraction", "data.stats/stored"}
    losses = acc.Scalars("trainer.step/loss")
    assert [(e.step, e.value) for e in losses] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert [e.value for e in acc.Scalars("data.stats/stored")] == [7.0]


def test_mlflow_file_store_run_holds_the_metric_history(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    _emit(tmp_path, [{"kind": "mlflow", "experiment": "exp"}])
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("exp")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "r1-dart-train" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "trainer.step/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.25), (3, 0.125)]


def test_wandb_offline_run_is_written_locally(tmp_path: Path) -> None:
    _emit(tmp_path, [{"kind": "wandb", "project": "p"}])
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()  # the W&B service process writes the log; it has flushed all of it once it is gone
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # what `wandb sync` uploads later
    history = []
    for data in _wandb_log_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    losses = [(row["trainer.step/step"], row["trainer.step/loss"]) for row in history if "trainer.step/loss" in row]
    assert losses == [(1, 0.5), (2, 0.25), (3, 0.125)]


def _wandb_log_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log: a 7-byte header (":W&B", magic, version), then LevelDB's log
    format: 32 KiB blocks of records, each with a 7-byte header (crc32, length, type: full/first/middle/last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    return records


def test_a_missing_tracker_package_is_a_clear_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if it were not installed
    with pytest.raises(ConfigError, match=r"dart-runtime\[tensorboard\]"):
        open_trackers([TensorBoardTrackerConfig()], run_dir=tmp_path, run_id="r", service="s")


def test_only_finite_numbers_of_tracked_events_are_forwarded() -> None:
    assert numeric_attributes({"a": 1, "b": 2.5, "c": True, "d": "x", "e": float("nan"), "f": [1]}) == {
        "a": 1.0,
        "b": 2.5,
    }
    tracker_set = TrackerSet([], ["trainer.step", "eval."])
    assert tracker_set.tracks("trainer.step") and tracker_set.tracks("eval.done")
    assert not tracker_set.tracks("trainer.stepped") and not tracker_set.tracks("data.stats")


def test_configs_are_discriminated_by_kind() -> None:
    config = TelemetryConfig.model_validate(
        {"trackers": [{"kind": "tensorboard"}, {"kind": "wandb", "mode": "offline"}, {"kind": "mlflow"}]}
    )
    assert [type(t) for t in config.trackers] == [TensorBoardTrackerConfig, WandbTrackerConfig, MlflowTrackerConfig]
    with pytest.raises(ValueError, match="kind"):
        TelemetryConfig.model_validate({"trackers": [{"kind": "comet"}]})
