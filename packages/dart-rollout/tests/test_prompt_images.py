"""Prompt images: the pixels fed to the processor and the record of exactly those pixels."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from dart.policy.prompt import HistoryStep, build_prompt, prompt_image
from dart.policy.screen import ResizeRule
from dart.protocol.messages import ImageRef, InlineImage
from dart.rollout.errors import ImageFetchError, ImageStoreError
from dart.rollout.service.images import ImageCache, PromptImages
from dart.runtime.store import LocalStore
from dart.runtime.store.images import ImageOffload
from dart.runtime.testing import png_header, tiny_png

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


def _desktop_1080p() -> bytes:
    """A 1920x1080 screen with text on it (a terminal's worth of lines): what PNG does not compress away."""
    screen = Image.new("RGB", (1920, 1080), (30, 30, 30))
    draw = ImageDraw.Draw(screen)
    for row in range(0, 1080, 14):
        draw.text((4, row), f"{row:04d} " + "dart rollout step prompt image " * 8, fill=(200, 220, 200))
    out = io.BytesIO()
    screen.save(out, format="PNG")
    return out.getvalue()


async def test_a_1080p_screen_resized_by_the_model_rule_is_recorded_by_reference(tmp_path: Path) -> None:
    """UI-TARS-1.5 at 1920x1080 (``image_size: model``): the resized PNG is larger than the screenshot and
    would fill the bus's message limit within a few dozen steps; it goes to the store once, by content,
    and the step records a reference whose bytes decode to exactly the pixels fed."""
    png = _desktop_1080p()
    shot = InlineImage(png=png, width=1920, height=1080)
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    offload = ImageOffload(store, 16 * 1024)
    images = PromptImages(ImageCache(), ResizeRule(min_pixels=3136, max_pixels=12_845_056), offload)

    fed = await images.prepare(shot)
    assert fed is not None and fed.pixels.size == (1932, 1092)
    record = fed.record
    assert isinstance(record, ImageRef) and (record.width, record.height) == (1932, 1092)
    key = f"screenshots/{record.sha256}.png"
    assert record.uri == store.uri(key)
    stored = store.get(key)
    assert len(stored) > 16 * 1024
    assert Image.open(io.BytesIO(stored)).convert("RGB").tobytes() == fed.pixels.tobytes()
    again = await images.prepare(shot)
    assert again is not None and again.record == record and offload.stored == 1 and offload.referenced == 2

    # Each step of the trajectory carries a reference of a few hundred bytes, not the image.
    assert len(record.model_dump_json()) < 512 < 16 * 1024 < len(stored)


async def test_a_resized_image_the_store_refuses_ends_the_step_with_a_named_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    store = LocalStore(tmp_path / "file" / "artifacts", create=False)  # a file where a directory must be
    images = PromptImages(ImageCache(), 224, ImageOffload(store, 0))
    with pytest.raises(ImageStoreError, match="rollout.prompt_images.inline_max_bytes"):
        await images.prepare(InlineImage(png=tiny_png(5, 4), width=5, height=4))
    # Below the threshold, or not resized: nothing is written.
    small = PromptImages(ImageCache(), None, ImageOffload(store, 0))
    shot = InlineImage(png=tiny_png(5, 4), width=5, height=4)
    fed = await small.prepare(shot)
    assert fed is not None and fed.record is shot


async def test_a_screenshot_is_decoded_only_at_the_size_it_declares(tmp_path: Path) -> None:
    """A forged or broken reference declaring a small screen over a 13k x 13k PNG is refused from its header,
    before anything is decoded (that image would be 0.5 GB of pixels)."""
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    bomb = png_header(13000, 13000)
    ref = ImageRef(
        uri=store.put("screenshots/bomb.png", bomb).uri, sha256=hashlib.sha256(bomb).hexdigest(), width=5, height=4
    )
    images = PromptImages(ImageCache(), 224)
    with pytest.raises(ImageFetchError, match="the PNG is 13000x13000, its message declares 5x4"):
        await images.prepare(ref)
    with pytest.raises(ImageFetchError, match=r"\(inline\).*the PNG is 5x4, its message declares 4x5"):
        await images.prepare(InlineImage(png=tiny_png(5, 4), width=4, height=5))
