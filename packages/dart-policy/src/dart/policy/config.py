"""What the policy is shown and how it answers: the prompt's settings (``rollout.runner.prompt``), one record
read by the rollout's runners and the warm start alike."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from dart.policy.formats import PROMPT_FORMATS, PromptFormat
from dart.policy.models import DEFAULT_FAMILY, MODEL_FAMILIES, Coordinates, ModelFamily, family_of
from dart.policy.screen import ImageSizing, ResizeRule
from dart.protocol.config import ConfigModel
from dart.protocol.errors import ConfigError

_PIXELS_NEED_A_SIZE = (
    "coordinates 'pixels' needs image_size (a side or 'model'): with None the processor resizes the screenshot "
    "on its own and the pixels the model sees are not known here"
)


class PromptConfig(ConfigModel):
    """What the policy is shown and how it answers: the one record of the prompt's settings.

    The rollout's runners build every prompt from it, the warm start builds its demonstrations from it,
    and the warm-start cache key includes all of it. The trainer needs none of it: each step records its
    prompt tokens and the images as fed.
    """

    max_images: int = Field(default=2, ge=1, le=16)
    """Screenshots in a prompt, the current one included; older steps appear as their text only."""
    image_size: Annotated[int, Field(ge=28)] | Literal["model"] | None = 224
    """How screenshots are sized before encoding (see :mod:`dart.policy.screen`): a side N stretches
    them to N x N (the tiny model's fixed token count); ``model`` keeps their aspect and sizes them by the
    checkpoint's image processor rule (sides multiples of 28, area within ``min_pixels`` .. ``max_pixels``),
    as a real Qwen2.5-VL sees a screen; None feeds them as captured."""
    min_pixels: int | None = Field(default=None, ge=1)
    """Smallest screenshot area under ``image_size: model``; None: the checkpoint processor's."""
    max_pixels: int | None = Field(default=None, ge=1)
    """Largest screenshot area under ``image_size: model`` (fewer visual tokens per screenshot); None: the
    checkpoint processor's (12,845,056 for Qwen2.5-VL: a 1920x1080 screen is 2,691 tokens)."""
    patch_factor: int = Field(default=28, ge=1)
    """Side of one visual token in pixels (``patch_size * merge_size``) under ``image_size: model``; filled
    in from the checkpoint with the pixel bounds."""
    format: str = "dart"
    """The prompt format (:mod:`dart.policy.formats`): ``dart`` (the project's prompt) or ``ui-tars-1.5``
    (UI-TARS-1.5's published computer-use prompt; pixel coordinates), or one another package registers."""
    coordinates: Coordinates | None = None
    """Where the positions the model writes live: ``grid``, a 0..1000 grid of the screen; ``pixels``, pixels
    of the screenshot as the model was shown it (UI-TARS-1.5's absolute coordinates), mapped back through
    the resize. None (the default): the format's own (``dart``: grid; ``ui-tars-1.5``: pixels)."""

    family: str | None = None
    """The model family whose chat frames the prompt; None: the checkpoint's (filled in when the rollout
    service reads it), else the default family's (Qwen2.5-VL)."""

    @field_validator("format")
    @classmethod
    def _registered_format(cls, name: str) -> str:
        return PROMPT_FORMATS.check_name(name)

    @field_validator("family")
    @classmethod
    def _registered_family(cls, name: str | None) -> str | None:
        return None if name is None else MODEL_FAMILIES.check_name(name)

    def prompt_format(self) -> PromptFormat:
        """The prompt format named by ``format`` (loaded from its registry)."""
        return PROMPT_FORMATS.get(self.format)

    def model_family(self) -> ModelFamily:
        """The family named by ``family`` (the default family when None)."""
        return MODEL_FAMILIES.get(self.family) if self.family is not None else DEFAULT_FAMILY

    def space(self) -> Coordinates:
        """The coordinate space the model is told to use: ``coordinates``, or the format's own when None.

        The format is loaded here, not when the config is validated (validation imports no plug-in code):
        the runners and the warm start ask at start, and ``dart run`` checks it before anything runs.

        Raises:
            ConfigError: The format cannot tell that space, or pixels without a known image size.
        """
        spaces = self.prompt_format().coordinate_spaces
        space = self.coordinates or spaces[0]
        if space not in spaces:
            raise ConfigError(
                "rollout.runner.prompt",
                "coordinates",
                f"{space!r}: the {self.format} prompt tells the model {' or '.join(spaces)} only",
            )
        if space == "pixels" and self.image_size is None:
            raise ConfigError("rollout.runner.prompt", "image_size", _PIXELS_NEED_A_SIZE)
        return space

    @model_validator(mode="after")
    def _pixels_need_a_known_image(self) -> PromptConfig:
        if self.coordinates == "pixels" and self.image_size is None:
            raise ValueError(_PIXELS_NEED_A_SIZE)
        return self

    def image_sizing(self) -> ImageSizing:
        """The sizing prompts apply (see :mod:`dart.policy.screen`).

        Raises:
            ConfigError: ``image_size: model`` with pixel bounds not filled in (see :meth:`resolved`).
        """
        if self.image_size != "model":
            return self.image_size
        if self.min_pixels is None or self.max_pixels is None:
            raise ConfigError(
                "prompt",
                "image_size",
                "image_size 'model' needs min_pixels and max_pixels: give them, or let the rollout service "
                "read them from the checkpoint (PromptConfig.resolved)",
            )
        try:
            return ResizeRule(self.min_pixels, self.max_pixels, self.patch_factor)
        except ValueError as exc:
            raise ConfigError("prompt", "max_pixels", str(exc)) from None

    def resolved(self, model_path: str | Path | None) -> PromptConfig:
        """These settings with what the checkpoint decides filled in: its model family (when ``family`` is
        None) and the pixel bounds of ``image_size: model`` from its image processor (a ``max_pixels`` given
        lowers the checkpoint's).

        Raises:
            ConfigError: ``image_size: model`` and neither bounds given nor a checkpoint that has them; or
                the checkpoint's family is not registered.
        """
        if self.family is None and model_path is not None:
            return self.model_copy(update={"family": family_of(model_path).name}).resolved(model_path)
        if self.image_size != "model" or (self.min_pixels is not None and self.max_pixels is not None):
            return self
        if model_path is None:
            raise ConfigError("prompt", "image_size", "image_size 'model' needs min_pixels/max_pixels or a checkpoint")
        rule = ResizeRule.of_checkpoint(model_path, max_pixels=self.max_pixels)
        low = self.min_pixels if self.min_pixels is not None else rule.min_pixels  # a ResizeRule keeps min <= max
        return self.model_copy(update={"min_pixels": low, "max_pixels": rule.max_pixels, "patch_factor": rule.factor})
