"""UI-TARS-style chat prompts: action space, instruction, recent screenshots and every previous action.

The prompt is a Qwen chat::

    <|im_start|>system\\n{SYSTEM_PROMPT}<|im_end|>
    <|im_start|>user\\n{ACTION_SPACE}\\n## User Instruction\\n{instruction}<|im_end|>
    (for each previous step)
      <|im_start|>user\\n<image><|im_end|>          only for the last ``max_images - 1`` steps
      <|im_start|>assistant\\n{step text}<|im_end|>  always: older screenshots are replaced by their actions
    <|im_start|>user\\n<image><|im_end|>            the current screenshot
    <|im_start|>assistant\\n                         generation starts here

where ``<image>`` is ``<|vision_start|><|image_pad|><|vision_end|>``; the processor expands each
``<|image_pad|>`` into as many pads as the image has visual tokens. :func:`encode_prompt` returns the
exact ``prompt_token_ids`` the model consumes, which the step record stores so the trainer recomputes
log-probs on the same tokens.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from dart.protocol.messages import ImageRef, InlineImage
from dart.rollout.model.screen import Coordinates, ImageSizing, coordinates_note, fit

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

SYSTEM_PROMPT = "You are a GUI agent. You are given a task and your action history, with screenshots."

ACTION_SPACE = """Output exactly in this format:
Thought: ...
Action: ...

## Action Space
click(start_box='(x,y)')
left_double(start_box='(x,y)')
right_single(start_box='(x,y)')
drag(start_box='(x1,y1)', end_box='(x2,y2)')
hotkey(key='ctrl c')
type(content='xxx')
scroll(start_box='(x,y)', direction='down or up or right or left')
wait()
finished(content='xxx')
fail(reason='xxx')

## Note
Coordinates are on a 0..1000 grid of the screen. End typed content with \\n to press Enter."""
"""The action call forms of :mod:`dart.rollout.action_grammar`, as the policy is told them (grid coordinates)."""


def action_space(coordinates: Coordinates = "grid") -> str:
    """:data:`ACTION_SPACE` with the sentence about positions for ``coordinates`` (see :mod:`.screen`)."""
    return ACTION_SPACE.replace(coordinates_note("grid"), coordinates_note(coordinates))


@dataclass(frozen=True)
class PromptImage:
    """A screenshot as the model is fed it, and the record of exactly those pixels.

    Attributes:
        pixels: The RGB image handed to the processor (resized already, when the runner resizes).
        record: A PNG whose RGB decode is ``pixels``: the screenshot itself (inline or by reference)
            when it was not resized, else the resized image encoded as a (lossless) PNG. The step
            stores it (``StepRecord.prompt_images``), so the trainer rebuilds the same pixels with no
            rule of its own.
    """

    pixels: Image.Image
    record: InlineImage | ImageRef


def prompt_image(png: bytes, size: ImageSizing, screenshot: InlineImage | ImageRef) -> PromptImage:
    """Decode a screenshot's PNG to RGB, resize it as ``size`` says when that changes it, and record the result.

    Args:
        png: The screenshot's PNG bytes.
        size: A side to stretch to, the model's :class:`~dart.rollout.model.screen.ResizeRule`, or None
            (kept as captured); bicubic either way.
        screenshot: The screenshot ``png`` belongs to: the record when no resize happens.
    """
    decoded = Image.open(io.BytesIO(png)).convert("RGB")
    pixels = fit(decoded, size)
    if pixels is decoded:
        return PromptImage(pixels, screenshot)
    out = io.BytesIO()
    pixels.save(out, format="PNG")
    return PromptImage(pixels, InlineImage(png=out.getvalue(), width=pixels.width, height=pixels.height))


ScreenshotLike = Image.Image | InlineImage | ImageRef | PromptImage


@dataclass(frozen=True)
class HistoryStep:
    """One earlier step of the episode, as the prompt shows it.

    Attributes:
        text: The policy's earlier output (``Thought: ... Action: ...``) or just its action text.
        screenshot: The screenshot that step acted on; shown only while among the last ``max_images``.
    """

    text: str
    screenshot: ScreenshotLike | None = None


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered prompt: chat text with one placeholder per image, and the images in order.

    Attributes:
        text: The chat text; each image is one ``IMAGE_PLACEHOLDER``.
        images: RGB images, already resized to the model's input size, in placeholder order.
        records: The records of ``images`` (see :class:`PromptImage`), in the same order, when every
            image was given as a :class:`PromptImage`; empty otherwise.
    """

    text: str
    images: tuple[Image.Image, ...] = field(default_factory=tuple)
    records: tuple[InlineImage | ImageRef, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class EncodedPrompt:
    """What the model consumes for one prompt.

    Attributes:
        input_ids: Prompt token ids, image pads expanded (record these as ``prompt_token_ids``).
        pixel_values: Flattened image patches, shape ``(num_patches, C * T * P * P)``, or None without images.
        image_grid_thw: ``(num_images, 3)`` patch grid per image (temporal, height, width), or None.
        mm_token_type_ids: Per prompt token, 1 for image tokens and 0 for text (``(1, len(input_ids))``);
            transformers derives the multimodal rotary positions from it, so a forward pass without it
            computes different log-probs.
    """

    input_ids: list[int]
    pixel_values: Any = None
    image_grid_thw: Any = None
    mm_token_type_ids: Any = None

    def forward_inputs(self, response_token_ids: Sequence[int] = ()) -> dict[str, Any]:
        """Model inputs for a teacher-forced pass over prompt + response (one row, no padding).

        ``log_softmax(logits[0, len(input_ids) - 1 : -1])`` gathered at the response tokens reproduces the
        engine's ``response_logprobs``.
        """
        import torch

        ids = torch.tensor([list(self.input_ids) + list(response_token_ids)])
        inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.mm_token_type_ids is not None:
            extra = torch.zeros((1, len(response_token_ids)), dtype=self.mm_token_type_ids.dtype)
            inputs["mm_token_type_ids"] = torch.cat([self.mm_token_type_ids, extra], dim=1)
        if self.pixel_values is not None:
            inputs["pixel_values"] = self.pixel_values
            inputs["image_grid_thw"] = self.image_grid_thw
        return inputs


def to_pil(image: ScreenshotLike, size: ImageSizing) -> Image.Image:
    """Decode a screenshot to RGB and resize it as ``size`` says (see :func:`prompt_image`).

    A :class:`PromptImage` is returned as fed (it was resized when it was made).

    Raises:
        ValueError: The screenshot is an :class:`ImageRef` (resolve it from the artifact store first).
    """
    if isinstance(image, PromptImage):
        return image.pixels
    if isinstance(image, ImageRef):
        raise ValueError(f"screenshot {image.uri} is a reference; fetch its bytes into an InlineImage first")
    pil = Image.open(io.BytesIO(image.png)) if isinstance(image, InlineImage) else image
    return fit(pil.convert("RGB"), size)


def _turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def build_prompt(
    instruction: str,
    screenshot: ScreenshotLike | None,
    history: Sequence[HistoryStep] = (),
    *,
    max_images: int = 1,
    image_size: ImageSizing = 224,
    system_prompt: str = SYSTEM_PROMPT,
    action_space: str = ACTION_SPACE,
) -> ChatPrompt:
    """Render the UI-TARS chat for the next step.

    Args:
        instruction: The task instruction.
        screenshot: The current screen (None for text-only environments).
        history: Every earlier step of the episode, oldest first.
        max_images: Screenshots shown at most, the current one included; older ones appear only as text.
        image_size: How screenshots are sized (see :func:`prompt_image`).
        system_prompt: The system message.
        action_space: The description of the action call forms.
    """
    if max_images < 1:
        raise ValueError(f"max_images must be at least 1, got {max_images}")
    parts = [_turn("system", system_prompt), _turn("user", f"{action_space}\n\n## User Instruction\n{instruction}")]
    shown: list[ScreenshotLike] = []
    first_with_image = len(history) - (max_images - 1)
    for i, step in enumerate(history):
        if i >= first_with_image and step.screenshot is not None:
            parts.append(_turn("user", IMAGE_PLACEHOLDER))
            shown.append(step.screenshot)
        parts.append(_turn("assistant", step.text))
    if screenshot is not None:
        parts.append(_turn("user", IMAGE_PLACEHOLDER))
        shown.append(screenshot)
    parts.append("<|im_start|>assistant\n")
    records = tuple(s.record for s in shown if isinstance(s, PromptImage))
    return ChatPrompt(
        text="".join(parts),
        images=tuple(to_pil(s, image_size) for s in shown),
        records=records if len(records) == len(shown) else (),
    )


def encode_prompt(processor: Any, prompt: ChatPrompt) -> EncodedPrompt:
    """Tokenize a prompt and turn its images into patches, exactly as the model will consume them.

    Args:
        processor: A Qwen2.5-VL processor (``AutoProcessor.from_pretrained(path)``).
        prompt: The rendered prompt.
    """
    if prompt.text.count(IMAGE_PLACEHOLDER) != len(prompt.images):
        raise ValueError(
            f"prompt has {prompt.text.count(IMAGE_PLACEHOLDER)} placeholders for {len(prompt.images)} images"
        )
    batch = processor(text=[prompt.text], images=list(prompt.images) or None, return_tensors="pt")
    return EncodedPrompt(
        input_ids=batch["input_ids"][0].tolist(),
        pixel_values=batch.get("pixel_values"),
        image_grid_thw=batch.get("image_grid_thw"),
        mm_token_type_ids=batch.get("mm_token_type_ids"),
    )
