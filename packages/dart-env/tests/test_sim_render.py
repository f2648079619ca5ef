"""Rendering: deterministic PNG bytes, the state visible on screen, and the cost per screenshot."""

from __future__ import annotations

import copy
import io
import time

import pytest
from PIL import Image

from dart.env.sim.families import FAMILIES, SimTask, SimTaskParams, build_task
from dart.env.sim.interaction import apply_action, to_normalized
from dart.env.sim.oracle import oracle_action
from dart.env.sim.render import DESKTOP, INSTRUCTION_BG, SELECTION_BG, render_image, render_png, wrap_text
from dart.env.sim.widgets import ListBox
from dart.protocol.messages import Click

pytestmark = pytest.mark.unit


def _task(family: str, difficulty: str = "medium", seed: int = 0) -> SimTask:
    params = SimTaskParams.model_validate({"family": family, "difficulty": difficulty, "seed": seed})
    return build_task(params, seed, 224, 224)


def test_same_state_renders_identical_png_bytes() -> None:
    for family in FAMILIES:
        a, b = _task(family, "hard", 5), _task(family, "hard", 5)
        assert render_png(a.window) == render_png(b.window)
        assert render_png(a.window) == render_png(copy.deepcopy(a.window))
        assert render_png(a.window) != render_png(_task(family, "hard", 6).window)
        png = render_png(a.window)
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) < 20_000
        assert Image.open(io.BytesIO(png)).size == (224, 224)


def test_every_state_change_shows_on_screen() -> None:
    for family in FAMILIES:
        task = _task(family, "hard", 2)
        seen = {render_png(task.window)}
        while (step := oracle_action(task)) is not None:
            apply_action(task.window, step[1])
            png = render_png(task.window)
            assert png not in seen, f"{family}: {step[0]} left the screen unchanged"
            seen.add(png)


def test_layout_colours_where_expected() -> None:
    task = _task("select-item", "easy", 1)
    lst = task.window.widget("list")
    assert isinstance(lst, ListBox)
    row = lst.row_rect(0)
    assert row is not None
    x, y = to_normalized(*row.center, 224, 224)
    apply_action(task.window, Click(x=x, y=y))
    image = render_image(task.window)
    assert image.getpixel((0, 0)) == DESKTOP
    bar = task.window.instruction_rect
    assert image.getpixel((bar.right - 3, bar.bottom - 3)) == INSTRUCTION_BG
    assert image.getpixel((row.right - 3, row.y + 2)) == SELECTION_BG  # the selected row is highlighted


def test_wrap_text_fits_the_width() -> None:
    lines = wrap_text("Select Banana from the list and then press the Submit button", 11, 120)
    assert len(lines) > 1 and " ".join(lines) == "Select Banana from the list and then press the Submit button"


def test_render_and_encode_time() -> None:
    windows = [_task(family, "hard", seed).window for family in FAMILIES for seed in range(5)]
    render_png(windows[0])  # warm the font cache
    rounds = 10
    start = time.perf_counter()
    for _ in range(rounds):
        for window in windows:
            render_png(window)
    per_shot_ms = (time.perf_counter() - start) / (rounds * len(windows)) * 1000
    print(f"sim render+encode: {per_shot_ms:.2f} ms per 224x224 screenshot")
    assert per_shot_ms < 50  # about 1 ms on a laptop core; a loose bound for slow CI machines
