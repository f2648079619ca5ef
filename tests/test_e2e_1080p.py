"""End to end at 1920x1080: `dart run examples/smoke-1080p.yaml` completes with nothing lost, its screenshots
travel by reference through the artifact store, and each stored step records the images its prompt was fed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dart.protocol.messages import ImageRef, Trajectory

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_1080p(dart_run: Callable[..., tuple[dict[str, Any], Path]]) -> tuple[dict[str, Any], Path]:
    return dart_run(ROOT / "examples" / "smoke-1080p.yaml")


def test_a_1080p_run_completes_with_nothing_lost(run_1080p: tuple[dict[str, Any], Path]) -> None:
    summary, _ = run_1080p
    assert summary["error"] is None
    assert summary["versions_published"] >= 2
    assert summary["trajectories_produced"] > 0
    assert summary["trajectories_produced"] == summary["trajectories_stored"]
    assert summary["trajectories_lost"] == 0
    assert summary["service_exit_codes"] == {"rollout": 0, "data": 0, "train": 0, "env": 0}
    # Screenshots by reference keep trajectories small: far below the bus's 8 MiB limit.
    assert 0 < summary["largest_trajectory_message_bytes"] < 1024 * 1024


def test_screenshots_went_by_reference_and_steps_record_what_was_fed(run_1080p: tuple[dict[str, Any], Path]) -> None:
    _, run_dir = run_1080p
    artifacts = run_dir / "artifacts"
    stored_shots = list((artifacts / "screenshots").glob("*.png"))
    assert stored_shots, "the env service stored no screenshot by reference"
    blob = next(iter(sorted((artifacts / "trajectories").glob("*/trajectory-*.json"))))
    trajectory = Trajectory.model_validate_json(blob.read_text())
    steps = [s for s in trajectory.steps if s.response_token_ids]
    assert steps
    for step in steps:
        shot = step.observation.screenshot
        assert isinstance(shot, ImageRef) and (shot.width, shot.height) == (1920, 1080)
        assert "/screenshots/" in shot.uri  # stored once by the env service, not re-uploaded by dart-data
        assert len(step.prompt_images) == 1  # max_images: 1
        assert all(isinstance(i, ImageRef) and (i.width, i.height) == (224, 224) for i in step.prompt_images)
