"""Coordinate round trips, per model family, prompt format and coordinate space: a click the policy writes for
a screen pixel lands on that pixel (within the coordinate space's own resolution) of a 1920x1080 and a 1280x720
screen, after the image sizing the family's processor applies; and the answer as later prompts show it back
(UI-TARS-1.5 wraps its points in box tokens) still means the same pixel.

The family's sizing is checked against transformers itself: the runner resizes a screenshot to
:class:`ResizeRule`'s size before the processor sees it, which must be the size the family's published image
processor settings give, or the processor would resize again and the model would see other pixels than the
step records.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from dart.policy.action_grammar import parse_action
from dart.policy.formats import PROMPT_FORMATS
from dart.policy.models import MODEL_FAMILIES
from dart.policy.screen import ResizeRule, coordinate_scale
from dart.protocol.messages import Click

pytestmark = pytest.mark.unit

SCREENS = [(1920, 1080), (1280, 720)]

PIXEL_BOUNDS = {
    # Published image processor settings: Qwen2.5-VL-*-Instruct and Qwen3-VL-*-Instruct.
    "qwen2.5-vl": (3136, 12_845_056),
    "qwen3-vl": (65_536, 16_777_216),
}
"""Every registered family's published bounds (the patch grid is the family's own)."""

FAMILIES = {
    name: {"min_pixels": low, "max_pixels": high} | vars(MODEL_FAMILIES.get(name))
    for name, (low, high) in PIXEL_BOUNDS.items()
}

FORMAT_SPACES = [(f, c) for f in PROMPT_FORMATS.names() for c in PROMPT_FORMATS.get(f).coordinate_spaces]
"""Each registered prompt format with each coordinate space it can tell the model to use."""


def test_every_registered_family_and_format_is_covered() -> None:
    assert set(PIXEL_BOUNDS) == set(MODEL_FAMILIES.names())
    assert {f for f, _ in FORMAT_SPACES} == {"dart", "ui-tars-1.5"}
    assert ("ui-tars-1.5", "pixels") in FORMAT_SPACES and ("ui-tars-1.5", "grid") not in FORMAT_SPACES


def _rule(family: str) -> ResizeRule:
    s = FAMILIES[family]
    return ResizeRule(s["min_pixels"], s["max_pixels"], s["patch_size"] * s["merge_size"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("screen", SCREENS)
def test_the_resize_is_the_one_the_familys_processor_applies(family: str, screen: tuple[int, int]) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    s = FAMILIES[family]
    processor = Qwen2VLImageProcessorPil(
        min_pixels=s["min_pixels"], max_pixels=s["max_pixels"], patch_size=s["patch_size"], merge_size=s["merge_size"]
    )
    shown = _rule(family).size(*screen)
    for image_size in (screen, shown):  # what the screen becomes, and an image already at that size stays so
        grid = processor(images=[Image.new("RGB", image_size)], return_tensors="np")["image_grid_thw"][0]
        assert (int(grid[2]) * s["patch_size"], int(grid[1]) * s["patch_size"]) == shown


def _landed(x: float, y: float, screen: tuple[int, int]) -> tuple[int, int]:
    """Where an env puts a normalized click on a screen (as the desktop and OSWorld backends do)."""
    width, height = screen
    return min(width - 1, max(0, round(x * width))), min(height - 1, max(0, round(y * height)))


@settings(max_examples=300, deadline=None)
@given(
    family=st.sampled_from(sorted(FAMILIES)),
    format_space=st.sampled_from(FORMAT_SPACES),
    screen=st.sampled_from(SCREENS),
    fx=st.floats(0.0, 1.0, exclude_max=True),
    fy=st.floats(0.0, 1.0, exclude_max=True),
)
def test_a_click_lands_on_the_intended_pixel(
    family: str, format_space: tuple[str, str], screen: tuple[int, int], fx: float, fy: float
) -> None:
    prompt_format, coordinates = PROMPT_FORMATS.get(format_space[0]), format_space[1]
    width, height = screen
    px, py = math.floor(fx * width), math.floor(fy * height)  # the pixel the policy means
    shown = _rule(family).size(width, height)
    sx, sy = coordinate_scale(coordinates, shown)  # type: ignore[arg-type]
    # The policy writes that pixel in its coordinate space, as an integer (as models do).
    u, v = round(px * sx / width), round(py * sy / height)
    answer = f"Thought: there.\nAction: click(start_box='({u},{v})')"
    parsed = parse_action(answer, (sx, sy))
    assert isinstance(parsed.action, Click), parsed.error
    # Later prompts show the answer back in the format's way; it still means the same point.
    assert parse_action(prompt_format.shown_answer(answer), (sx, sy)).action == parsed.action
    lx, ly = _landed(parsed.action.x, parsed.action.y, screen)
    # Off by at most half a coordinate unit (in screen pixels) and the env's rounding: exactly the pixel when
    # the coordinate space is at least as fine as the screen (the shown image's pixels, mostly), within one
    # pixel on the 0..1000 grid of a 1920 or 1280 px side or a shown side below the screen's.
    assert abs(lx - px) <= math.floor(0.5 * width / sx + 0.5)
    assert abs(ly - py) <= math.floor(0.5 * height / sy + 0.5)
    if sx >= width and sy >= height:
        assert (lx, ly) == (px, py)
