"""Prompt images: the pixels fed to the processor and the record of exactly those pixels."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from dart.protocol.messages import ImageRef, InlineImage
from dart.protocol.testing import tiny_png
from dart.rollout.errors import ImageFetchError
from dart.rollout.model.prompt import HistoryStep, build_prompt, prompt_image
from dart.rollout.service.images import ImageCache

pytestmark = pytest.mark.unit


def _png(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGBA", size, (*color, 255)).save(out, format="PNG")
    return out.getvalue()


def test_a_resized_screenshot_is_recorded_as_the_pixels_fed() -> None:
    png = _png((640, 360), (10, 200, 30))
    shot = InlineImage(png=png, width=640, height=360)
    fed = prompt_image(png, 224, shot)
    assert fed.pixels.size == (224, 224) and fed.pixels.mode == "RGB"
    assert isinstance(fed.record, InlineImage) and (fed.record.width, fed.record.height) == (224, 224)
    decoded = Image.open(io.BytesIO(fed.record.png)).convert("RGB")
    assert decoded.tobytes() == fed.pixels.tobytes()  # lossless: the record is the pixels
    same = prompt_image(png, None, shot)
    assert same.record is shot and same.pixels.size == (640, 360)


def test_build_prompt_records_the_images_it_shows_in_prompt_order() -> None:
    shots = [prompt_image(tiny_png(w, 3), None, InlineImage(png=tiny_png(w, 3), width=w, height=3)) for w in (4, 5, 6)]
    history = [HistoryStep("Action: wait()", shots[0]), HistoryStep("Action: wait()", shots[1])]
    prompt = build_prompt("do it", shots[2], history, max_images=2)
    assert [r.width for r in prompt.records] == [5, 6]  # the window: previous step's, then the current one
    assert len(prompt.images) == 2
    plain = build_prompt("do it", Image.new("RGB", (8, 8)), max_images=1)
    assert plain.records == ()  # a bare PIL image has no record


def test_an_unreadable_reference_is_an_image_fetch_error(tmp_path: Path) -> None:
    ref = ImageRef(uri=(tmp_path / "gone.png").as_uri(), sha256="0" * 64, width=4, height=4)
    with pytest.raises(ImageFetchError, match="gone.png"):
        ImageCache().get(ref)
