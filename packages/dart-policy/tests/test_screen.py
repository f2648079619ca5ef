"""Prompt screenshots at the model's own resolution rule, and pixel coordinates mapped back to the screen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from dart.policy.action_grammar import format_action, parse_action
from dart.policy.architectures import get_architecture
from dart.policy.formats import DART, DART_ACTION_SPACE
from dart.policy.prompt import build_prompt
from dart.policy.screen import ResizeRule, coordinate_scale, fit
from dart.protocol.errors import ConfigError
from dart.protocol.messages import Click, Drag

pytestmark = pytest.mark.unit

# Screens of real desktops and phones, and the extremes the rule has to handle (tiny, very long).
SCREENS = [(1920, 1080), (1280, 720), (2560, 1440), (1366, 768), (1080, 2400), (800, 600), (56, 56), (30, 5000)]


def _processor_grid(rule: ResizeRule, image: Image.Image) -> tuple[int, int]:
    """``(width, height)`` in pixels that Qwen2.5-VL's own image processor resizes ``image`` to."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=rule.min_pixels, max_pixels=rule.max_pixels)
    _, h, w = processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    return w * 14, h * 14


@pytest.mark.parametrize("screen", SCREENS)
def test_the_resize_rule_is_the_processors_and_the_processor_keeps_its_result(screen: tuple[int, int]) -> None:
    p = get_architecture("qwen2.5-vl-3b").processing
    rule = ResizeRule(p.min_pixels, p.max_pixels, p.patch_size * p.merge_size)
    image = Image.new("RGB", screen, (30, 120, 200))
    assert rule.size(*screen) == _processor_grid(rule, image)
    resized = fit(image, rule)
    assert resized.size == rule.size(*screen)
    # What the runner feeds is what the model sees: the processor resizes it no further.
    assert _processor_grid(rule, resized) == resized.size
    w, h = resized.size
    assert w % 28 == 0 and h % 28 == 0 and w * h <= p.max_pixels


def test_a_1080p_screen_keeps_its_aspect_and_a_lower_max_pixels_lowers_the_token_count() -> None:
    published = ResizeRule(3136, 12845056)
    assert published.size(1920, 1080) == (1932, 1092) and published.visual_tokens(1920, 1080) == 69 * 39
    capped = ResizeRule(3136, 1_000_000)
    w, h = capped.size(1920, 1080)
    assert w * h <= 1_000_000 and abs(w / h - 16 / 9) < 0.05
    assert capped.visual_tokens(1920, 1080) < published.visual_tokens(1920, 1080)
    # A square side stretches, as the tiny model's fixed token count needs.
    assert fit(Image.new("RGB", (1920, 1080)), 224).size == (224, 224)


def test_bad_bounds_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="min_pixels"):
        ResizeRule(100, 5000)  # below one 28 x 28 cell
    with pytest.raises(ValueError, match="max_pixels"):
        ResizeRule(5000, 4000)
    with pytest.raises(ValueError, match="200 times"):
        ResizeRule(3136, 12845056).size(10, 2500)


def test_the_rule_is_read_from_either_processor_file(tmp_path: Path) -> None:
    published = tmp_path / "published"
    published.mkdir()
    (published / "preprocessor_config.json").write_text(
        json.dumps({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2})
    )
    assert ResizeRule.of_checkpoint(published) == ResizeRule(3136, 12845056, 28)
    assert ResizeRule.of_checkpoint(published, max_pixels=1_000_000).max_pixels == 1_000_000
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "processor_config.json").write_text(
        json.dumps({"image_processor": {"size": {"shortest_edge": 50176, "longest_edge": 50176}, "patch_size": 14}})
    )
    assert ResizeRule.of_checkpoint(saved) == ResizeRule(50176, 50176, 28)
    with pytest.raises(ConfigError, match="no image processor config"):
        ResizeRule.of_checkpoint(tmp_path)


def test_pixel_coordinates_map_back_through_the_resize() -> None:
    shown = ResizeRule(3136, 12845056).size(1920, 1080)  # 1932 x 1092
    scale = coordinate_scale("pixels", shown)
    parsed = parse_action("Thought: the middle.\nAction: click(start_box='(966,546)')", scale)
    assert parsed.action == Click(x=0.5, y=0.5)
    drag = parse_action("Action: drag(start_box='(0,0)', end_box='(1932,1092)')", scale).action
    assert drag == Drag(x1=0.0, y1=0.0, x2=1.0, y2=1.0)
    outside = parse_action("Action: click(start_box='(1933,10)')", scale)
    assert outside.action is None and "1932x1092 screenshot" in str(outside.error)
    # Formatting is the inverse (what demonstrations are written in).
    assert format_action(Click(x=0.25, y=0.75), scale) == "click(start_box='(483,819)')"
    # The grid is the default and does not depend on the image.
    assert coordinate_scale("grid", None) == (1000.0, 1000.0)
    with pytest.raises(ValueError, match="screenshot"):
        coordinate_scale("pixels", None)


def test_the_prompt_tells_the_model_which_coordinates_it_writes() -> None:
    assert DART.task_prompt("Click OK.", "grid").startswith(DART_ACTION_SPACE)
    pixels = DART.task_prompt("Click OK.", "pixels")
    assert "0..1000" not in pixels and "pixels of the current screenshot" in pixels
    prompt = build_prompt("Click OK.", Image.new("RGB", (1920, 1080)), image_size=ResizeRule(3136, 12845056))
    assert prompt.images[0].size == (1932, 1092)
