"""Chat prompts for GUI agents: task prompt, recent screenshots and every previous answer.

The prompt is the model family's chat (:class:`~dart.policy.models.ChatFormat`; Qwen's ChatML here)
around a prompt format's messages (:mod:`dart.policy.formats`)::

    <|im_start|>system\\n{format.system_prompt()}<|im_end|>
    <|im_start|>user\\n{format.task_prompt(instruction, coordinates)}<|im_end|>
    (for each previous step)
      <|im_start|>user\\n<image><|im_end|>          only for the last ``max_images - 1`` steps
      <|im_start|>assistant\\n{format.shown_answer(step text)}<|im_end|>   always: older screenshots go
    <|im_start|>user\\n<image><|im_end|>            the current screenshot
    <|im_start|>assistant\\n                         generation starts here

where ``<image>`` is the family's image placeholder (``<|vision_start|><|image_pad|><|vision_end|>``); the
processor expands each ``<|image_pad|>`` into as many pads as the image has visual tokens.
:func:`encode_prompt` returns the exact ``prompt_token_ids`` the model consumes, which the step record stores
so the trainer recomputes log-probs on the same tokens.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from dart.policy.formats import DART, PromptFormat
from dart.policy.models import DEFAULT_FAMILY, QWEN_CHAT, ChatFormat, Coordinates
from dart.policy.screen import ImageSizing, fit
from dart.protocol.messages import ImageRef, InlineImage

IMAGE_PLACEHOLDER = QWEN_CHAT.image
"""The image placeholder of the Qwen families' chat."""


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
        size: A side to stretch to, the model's :class:`~dart.policy.screen.ResizeRule`, or None
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
        text: The chat text; each image is one placeholder of the family's chat.
        images: RGB images, already resized to the model's input size, in placeholder order.
        records: The records of ``images`` (see :class:`PromptImage`), in the same order, when every
            image was given as a :class:`PromptImage`; empty otherwise.
        image_placeholder: What stands for one image in ``text`` (the family's).
    """

    text: str
    images: tuple[Image.Image, ...] = field(default_factory=tuple)
    records: tuple[InlineImage | ImageRef, ...] = field(default_factory=tuple)
    image_placeholder: str = IMAGE_PLACEHOLDER


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


def build_prompt(
    instruction: str,
    screenshot: ScreenshotLike | None,
    history: Sequence[HistoryStep] = (),
    *,
    max_images: int = 1,
    image_size: ImageSizing = 224,
    prompt_format: PromptFormat = DART,
    coordinates: Coordinates | None = None,
    chat: ChatFormat = DEFAULT_FAMILY.chat,
) -> ChatPrompt:
    """Render the chat for the next step.

    Args:
        instruction: The task instruction.
        screenshot: The current screen (None for text-only environments).
        history: Every earlier step of the episode, oldest first.
        max_images: Screenshots shown at most, the current one included; older ones appear only as text.
        image_size: How screenshots are sized (see :func:`prompt_image`).
        prompt_format: What the model is told, and how its earlier answers are shown.
        coordinates: The coordinate space the model is told to answer in; None: the format's own.
        chat: The model family's chat turns and image placeholder.

    Raises:
        ValueError: ``max_images`` below 1, or a coordinate space the format cannot tell.
    """
    if max_images < 1:
        raise ValueError(f"max_images must be at least 1, got {max_images}")
    space = coordinates or prompt_format.coordinate_spaces[0]
    parts = [
        chat.message("system", prompt_format.system_prompt()),
        chat.message("user", prompt_format.task_prompt(instruction, space)),
    ]
    shown: list[ScreenshotLike] = []
    first_with_image = len(history) - (max_images - 1)
    for i, step in enumerate(history):
        if i >= first_with_image and step.screenshot is not None:
            parts.append(chat.message("user", chat.image))
            shown.append(step.screenshot)
        parts.append(chat.message("assistant", prompt_format.shown_answer(step.text)))
    if screenshot is not None:
        parts.append(chat.message("user", chat.image))
        shown.append(screenshot)
    parts.append(chat.generation_prompt)
    records = tuple(s.record for s in shown if isinstance(s, PromptImage))
    return ChatPrompt(
        text="".join(parts),
        images=tuple(to_pil(s, image_size) for s in shown),
        records=records if len(records) == len(shown) else (),
        image_placeholder=chat.image,
    )


def encode_prompt(processor: Any, prompt: ChatPrompt) -> EncodedPrompt:
    """Tokenize a prompt and turn its images into patches, exactly as the model will consume them.

    Args:
        processor: The checkpoint's processor (``AutoProcessor.from_pretrained(path)``).
        prompt: The rendered prompt.
    """
    placeholders = prompt.text.count(prompt.image_placeholder)
    if placeholders != len(prompt.images):
        raise ValueError(f"prompt has {placeholders} placeholders for {len(prompt.images)} images")
    batch = processor(text=[prompt.text], images=list(prompt.images) or None, return_tensors="pt")
    return EncodedPrompt(
        input_ids=batch["input_ids"][0].tolist(),
        pixel_values=batch.get("pixel_values"),
        image_grid_thw=batch.get("image_grid_thw"),
        mm_token_type_ids=batch.get("mm_token_type_ids"),
    )
