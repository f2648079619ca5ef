"""End to end on real desktops at real size: `dart run examples/smoke-desktop-1080p.yaml` (the short form of
examples/desktop-1080p.yaml) runs the four services on local X desktops at 1920x1080 with xterm and mousepad
open, UI-TARS-1.5's prompt, screens fed at the model's own resolution rule with two earlier ones of history,
and every image by reference. Its own records show that nothing was lost, that the trajectory messages stayed
small, and that each stored step holds references to what the policy saw."""

from __future__ import annotations

import io
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image

from dart.policy.screen import ResizeRule
from dart.protocol.messages import ImageRef, TrajectoryStatus
from dart.protocol.messages.codec import COMPRESS_ABOVE_BYTES
from dart.runtime.store import resolve_uri

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "smoke-desktop-1080p.yaml"
MISSING = [p for p in ("Xvfb", "openbox", "xterm", "mousepad", "xdotool") if shutil.which(p) is None]

sys.path.insert(0, str(ROOT / "benchmarks"))
import trajectory_bytes  # noqa: E402  # the benchmark's own measure, run on this run

needs_desktop = pytest.mark.skipif(
    bool(MISSING), reason=f"local desktop programs missing: {MISSING} (.ci/run installs them)"
)


@pytest.fixture(scope="module")
def desktop_run(dart_run: Callable[..., tuple[dict[str, Any], Path]]) -> tuple[dict[str, Any], Path]:
    return dart_run(CONFIG)


def _png(ref: ImageRef) -> Image.Image:
    store, key = resolve_uri(ref.uri)
    with store:
        return Image.open(io.BytesIO(store.get(key))).convert("RGB")


@needs_desktop
def test_the_desktop_run_trains_two_versions_with_nothing_lost_and_small_messages(
    desktop_run: tuple[dict[str, Any], Path],
) -> None:
    summary, run_dir = desktop_run
    assert summary["error"] is None
    assert summary["service_exit_codes"] == {"rollout": 0, "data": 0, "train": 0, "env": 0}
    assert summary["versions_published"] >= 2 and summary["engine_weight_updates"] >= 2
    assert summary["trajectories_produced"] > 0 and summary["trajectories_lost"] == 0
    assert 0 < summary["largest_trajectory_message_bytes"] < 256 * 1024
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    prompt = config["rollout"]["runner"]["prompt"]
    assert (prompt["format"], prompt["image_size"], prompt["max_images"]) == ("ui-tars-1.5", "model", 3)
    desktop = config["env"]["osworld"]["desktop"]
    assert (desktop["width"], desktop["height"]) == (1920, 1080)

    trajectories = trajectory_bytes.stored_trajectories(run_dir)
    assert len(trajectories) == summary["trajectories_stored"]
    ended = [t for t in trajectories if t.status in (TrajectoryStatus.OK, TrajectoryStatus.TRUNCATED)]
    steps = [len(t.steps) for t in ended]
    assert summary["mean_steps_per_trajectory"] == round(statistics.fmean(steps), 2)
    assert summary["max_steps_per_trajectory"] == max(steps) <= config["max_steps"]
    assert {t.task.task_id.split("/")[1] for t in trajectories} >= {"terminal", "text_editor"}


@needs_desktop
def test_every_step_holds_references_to_the_1080p_screen_and_the_history_it_was_fed(
    desktop_run: tuple[dict[str, Any], Path],
) -> None:
    _, run_dir = desktop_run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    rule = ResizeRule.of_checkpoint(
        config["train"]["model_path"], max_pixels=config["rollout"]["runner"]["prompt"]["max_pixels"]
    )
    fed = rule.size(1920, 1080)
    shown: set[str] = set()
    for trajectory in trajectory_bytes.stored_trajectories(run_dir):
        first = trajectory.steps[0].index if trajectory.steps else 0
        for step in trajectory.steps:
            shot = step.observation.screenshot
            assert isinstance(shot, ImageRef) and (shot.width, shot.height) == (1920, 1080)
            # The current screen and up to two earlier ones, each the screen resized by the model's rule.
            assert len(step.prompt_images) == min(step.index - first + 1, 3)
            assert all(isinstance(i, ImageRef) and (i.width, i.height) == fed for i in step.prompt_images)
            shown.add(shot.uri)
    # Real applications on the screens: windows, not an empty root window.
    lit = []
    for uri in sorted(shown):
        sha = uri.rsplit("/", 1)[1].removesuffix(".png")
        pixels = _png(ImageRef(uri=uri, sha256=sha, width=1920, height=1080)).convert("L").point(lambda v: v > 16)
        lit.append(sum(pixels.histogram()[1:]) / (1920 * 1080))
    assert max(lit) > 0.02, lit


@needs_desktop
def test_the_benchmark_counts_what_the_images_would_weigh_inline(desktop_run: tuple[dict[str, Any], Path]) -> None:
    summary, run_dir = desktop_run
    figures = trajectory_bytes.measure(run_dir)
    assert figures["trajectories"] == summary["trajectories_stored"]
    # The stored trajectory rebuilt as it travelled weighs what the bus counted (its own encoding of it).
    assert abs(figures["by_reference"]["max_bytes"] - summary["largest_trajectory_message_bytes"]) < 1024
    # Its JSON is above the codec's threshold: it travelled compressed.
    assert figures["by_reference_json"]["max_bytes"] > COMPRESS_ABOVE_BYTES
    assert figures["by_reference"]["max_bytes"] < figures["by_reference_json"]["max_bytes"] // 2
    assert figures["by_reference"]["mean_bytes"] < figures["prompt_images_inline"]["mean_bytes"]
    assert figures["prompt_images_inline"]["mean_bytes"] < figures["all_inline"]["mean_bytes"]
    assert figures["max_prompt_images_per_step"] == 3
