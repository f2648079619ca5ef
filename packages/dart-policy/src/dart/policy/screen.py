"""How a screenshot is sized for the prompt, and how the model's coordinates map back to the screen.

Two ways to size a screenshot (``runner.prompt.image_size``):

- a side ``N``: stretched to ``N`` x ``N`` (a fixed visual token count; the tiny CPU model's way);
- ``model``: the checkpoint's own rule, as Qwen2.5-VL's image processor applies it
  (:class:`ResizeRule`): the aspect ratio kept, each side a multiple of the patch grid
  (``patch_size * merge_size``, 28), the area within the processor's ``min_pixels`` and
  ``max_pixels``. A 1920x1080 screen becomes 1932x1092 (2,691 visual tokens) under the published
  Qwen2.5-VL bounds. The runner resizes before the processor sees the image, so the step records
  exactly the pixels fed, and the processor's own resize leaves them as they are.

Two coordinate spaces for the positions the model writes (``runner.prompt.coordinates``):

- ``grid``: a 0..1000 grid of the screen, whatever the image size (the default);
- ``pixels``: pixels of the screenshot as the model was shown it (UI-TARS-1.5 and Qwen2.5-VL's
  absolute coordinates): ``(x, y)`` maps back to the screen as ``(x / width, y / height)`` of the
  shown image, so a point means the same place on screen whatever the resize did.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from dart.policy.models import Coordinates
from dart.protocol.errors import ConfigError

GRID = 1000
"""Side of the ``grid`` coordinate space."""
MAX_ASPECT = 200
"""Qwen2.5-VL refuses images whose long side is more than this many times the short one."""


@dataclass(frozen=True)
class ResizeRule:
    """Qwen2.5-VL's aspect-preserving resize.

    Attributes:
        min_pixels: Smallest area after the resize.
        max_pixels: Largest area after the resize.
        factor: Each side becomes a multiple of it (``patch_size * merge_size``).
    """

    min_pixels: int
    max_pixels: int
    factor: int = 28

    def __post_init__(self) -> None:
        if self.factor < 1 or self.min_pixels < self.factor**2 or self.max_pixels < self.min_pixels:
            raise ValueError(
                f"resize bounds need factor**2 <= min_pixels <= max_pixels, got factor {self.factor}, "
                f"min_pixels {self.min_pixels}, max_pixels {self.max_pixels}"
            )

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The ``(width, height)`` an image of this size is resized to.

        Each side is rounded to the nearest multiple of ``factor``; when the area is then above
        ``max_pixels`` (below ``min_pixels``) both sides are scaled down (up) by the same factor and
        rounded down (up) to multiples of ``factor``.

        Raises:
            ValueError: An empty image, or one more than 200 times wider than high (or the reverse).
        """
        if width < 1 or height < 1:
            raise ValueError(f"cannot resize an empty {width}x{height} image")
        if max(width, height) / min(width, height) > MAX_ASPECT:
            raise ValueError(f"a {width}x{height} image is more than {MAX_ASPECT} times longer than wide")
        f = self.factor
        w, h = max(f, round(width / f) * f), max(f, round(height / f) * f)
        if w * h > self.max_pixels:
            beta = math.sqrt(width * height / self.max_pixels)
            w, h = max(f, math.floor(width / beta / f) * f), max(f, math.floor(height / beta / f) * f)
        elif w * h < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (width * height))
            w, h = math.ceil(width * beta / f) * f, math.ceil(height * beta / f) * f
        return w, h

    def visual_tokens(self, width: int, height: int) -> int:
        """Visual tokens an image of this size becomes (one per ``factor`` x ``factor`` cell)."""
        w, h = self.size(width, height)
        return (w // self.factor) * (h // self.factor)

    @classmethod
    def of_checkpoint(cls, path: str | Path, *, max_pixels: int | None = None) -> ResizeRule:
        """The rule of a checkpoint's image processor, optionally with a lower ``max_pixels``.

        Reads ``preprocessor_config.json`` (as published checkpoints carry it: ``min_pixels``,
        ``max_pixels``, ``patch_size``, ``merge_size``) or ``processor_config.json``'s
        ``image_processor`` (as transformers 5 saves it: ``size.shortest_edge`` / ``longest_edge``).

        Raises:
            ConfigError: Neither file is there, or it does not give the bounds.
        """
        root = Path(path)
        settings: dict[str, object] | None = None
        for name, section in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
            file = root / name
            if file.is_file():
                loaded = json.loads(file.read_text())
                settings = loaded.get(section) if section else loaded
                if isinstance(settings, dict):
                    break
        if not isinstance(settings, dict):
            raise ConfigError(
                "runner", "image_size", f"{root} has no image processor config (preprocessor_config.json)"
            )
        size = settings.get("size") if isinstance(settings.get("size"), dict) else {}
        assert isinstance(size, dict)
        low = settings.get("min_pixels", size.get("shortest_edge"))
        high = settings.get("max_pixels", size.get("longest_edge"))
        patch, merge = settings.get("patch_size", 14), settings.get("merge_size", 2)
        if not all(isinstance(v, int) for v in (low, high, patch, merge)):
            raise ConfigError("prompt", "image_size", f"{root}'s image processor config gives no min/max pixels")
        assert isinstance(low, int) and isinstance(high, int) and isinstance(patch, int) and isinstance(merge, int)
        if max_pixels is not None:
            high = min(high, max_pixels)
        try:
            return cls(min_pixels=min(low, high), max_pixels=high, factor=patch * merge)
        except ValueError as exc:
            raise ConfigError("prompt", "max_pixels", str(exc)) from None


ImageSizing = int | ResizeRule | None
"""How a prompt image is sized: a square side, a :class:`ResizeRule`, or None (as captured)."""


def fit(image: Image.Image, sizing: ImageSizing) -> Image.Image:
    """``image`` resized as ``sizing`` says (bicubic, as the processor resamples); the same object when
    no resize is needed."""
    if sizing is None:
        return image
    target = (sizing, sizing) if isinstance(sizing, int) else sizing.size(*image.size)
    if image.size == target:
        return image
    return image.resize(target, Image.Resampling.BICUBIC)


def coordinate_scale(coordinates: Coordinates, shown: tuple[int, int] | None) -> tuple[float, float]:
    """What positions in the model's text are divided by to become normalized screen coordinates.

    Args:
        coordinates: The coordinate space the model writes in.
        shown: ``(width, height)`` of the screenshot as the model was shown it.

    Raises:
        ValueError: ``pixels`` coordinates without a shown screenshot.
    """
    if coordinates == "grid":
        return float(GRID), float(GRID)
    if shown is None:
        raise ValueError("pixel coordinates need the screenshot the model was shown")
    return float(shown[0]), float(shown[1])


def coordinates_note(coordinates: Coordinates) -> str:
    """The action space's sentence about positions."""
    if coordinates == "grid":
        return f"Coordinates are on a 0..{GRID} grid of the screen."
    return "Coordinates are pixels of the current screenshot as you see it: x from the left, y from the top."
