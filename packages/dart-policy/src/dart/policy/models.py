"""Model families: everything that differs between families of checkpoints, asked of one object.

A :class:`ModelFamily` is data every service can read without importing model code; it is the one place
the rest of DART asks about a family:

- the rollout engines and every trainer backend load a checkpoint with ``family.model_cls()`` after
  :func:`family_of` found its family from ``config.json`` (a checkpoint of a family nobody registered is
  refused with one clear error instead of being loaded with the wrong class);
- the prompt builder writes the family's chat turns and image placeholder (:class:`ChatFormat`);
- the image sizing reads the family's patch grid (``patch_size * merge_size``) with the checkpoint's
  pixel bounds;
- ``dart model init`` writes tiny and real-architecture checkpoints through the family's writer module
  (``writer``: tokenizer-free config, processor and published sizes);
- the megatron backend converts only families with ``megatron=True`` and refuses the others at start.

The trainer's forward needs nothing of its own per family: both Qwen classes compute their multimodal
rotary positions from ``input_ids``, ``image_grid_thw`` and ``mm_token_type_ids``, which every step
records, and the log-prob equality tests check it per family and engine.

Adding a family is one module (its :class:`ModelFamily` and its writer functions) plus an entry point
of the group ``dart.model_families`` (see :mod:`dart.protocol.registry`); dart-policy registers
``qwen2.5-vl`` and ``qwen3-vl``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dart.protocol.errors import ConfigError
from dart.protocol.registry import Registry


@dataclass(frozen=True)
class ChatFormat:
    """How a family's chat is written as text (token-in/token-out: the prompt builder renders it itself).

    Attributes:
        turn: One message, with ``{role}`` and ``{content}`` fields.
        generation_prompt: What opens the assistant's reply the model writes.
        image: What stands for one image in a message (the processor expands it to the image's tokens).
        end_of_turn: The token that ends a reply (the engines stop on it; demonstrations end with it).
    """

    turn: str
    generation_prompt: str
    image: str
    end_of_turn: str

    def message(self, role: str, content: str) -> str:
        """One message of ``role`` (``system``, ``user`` or ``assistant``)."""
        return self.turn.format(role=role, content=content)


QWEN_CHAT = ChatFormat(
    turn="<|im_start|>{role}\n{content}<|im_end|>\n",
    generation_prompt="<|im_start|>assistant\n",
    image="<|vision_start|><|image_pad|><|vision_end|>",
    end_of_turn="<|im_end|>",
)
"""ChatML with Qwen's vision markers: Qwen2-VL, Qwen2.5-VL and Qwen3-VL write it alike."""

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
"""Tokens that end a response (Qwen's chat): the engines stop on them."""
BANNED_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|im_start|>",
)
"""Never sampled: a vision placeholder in a response would break the trainer's forward pass (image tokens
must match images), and a new turn is not a valid response. They are recorded as the result's
``SamplingParams.excluded_token_ids``, so the trainer masks them when it recomputes log-probs."""

Coordinates = Literal["grid", "pixels"]
"""Where a model's positions live: ``grid``, a 0..1000 grid of the screen; ``pixels``, pixels of the
screenshot as the model was shown it (after the image sizing)."""


@dataclass(frozen=True)
class ModelFamily:
    """One family of vision-language checkpoints (see the module docstring for who asks what).

    Attributes:
        name: The family's registered name (``qwen2.5-vl``).
        model_types: ``config.json`` ``model_type`` values of its checkpoints.
        model_class: Name of the transformers class that loads them (an attribute of ``transformers``).
        processor_class: Name of the transformers processor class of its checkpoints.
        patch_size: Vision patch side, pixels.
        merge_size: Patches merged per side into one language-model token.
        chat: How its chat is written.
        writer: Module with the family's checkpoint writers: ``tiny_config``, ``processor`` and
            ``ARCHITECTURES`` (see :mod:`dart.policy.families`); imported only by ``dart model init``
            and the tiny writer.
        megatron: Whether the megatron backend converts its checkpoints.
    """

    name: str
    model_types: tuple[str, ...]
    model_class: str
    processor_class: str
    patch_size: int
    merge_size: int
    writer: str
    chat: ChatFormat = QWEN_CHAT
    megatron: bool = False

    def processor_cls(self) -> Any:
        """The transformers processor class (imports transformers)."""
        import transformers

        return getattr(transformers, self.processor_class)

    @property
    def patch_factor(self) -> int:
        """Side of one language-model visual token, pixels (``patch_size * merge_size``)."""
        return self.patch_size * self.merge_size

    def model_cls(self) -> Any:
        """The transformers class (imports transformers)."""
        import transformers

        return getattr(transformers, self.model_class)


QWEN2_5_VL = ModelFamily(
    name="qwen2.5-vl",
    model_types=("qwen2_5_vl",),
    model_class="Qwen2_5_VLForConditionalGeneration",
    processor_class="Qwen2_5_VLProcessor",
    patch_size=14,
    merge_size=2,
    writer="dart.policy.families.qwen2_5_vl",
    megatron=True,
)
"""Qwen2.5-VL (3B/7B/32B/72B-Instruct, UI-TARS-1.5-7B, the tiny test model): windowed vision attention,
14 px patches."""

QWEN3_VL = ModelFamily(
    name="qwen3-vl",
    model_types=("qwen3_vl",),
    model_class="Qwen3VLForConditionalGeneration",
    processor_class="Qwen3VLProcessor",
    patch_size=16,
    merge_size=2,
    writer="dart.policy.families.qwen3_vl",
)
"""Qwen3-VL, dense (2B/4B/8B/32B): deepstack vision features, interleaved 3-D rope, 16 px patches."""

DEFAULT_FAMILY = QWEN2_5_VL
"""The family prompts are written for when no checkpoint is known (scripted runs, tests)."""


def _is_family(obj: object) -> None:
    if not isinstance(obj, ModelFamily):
        raise TypeError(f"a model family must be a ModelFamily, got {obj!r}")


MODEL_FAMILIES: Registry[ModelFamily] = Registry(
    "model_families", what="model family", config_field="model", check=_is_family
)
"""Model families by name."""


def family_of(checkpoint: str | Path) -> ModelFamily:
    """The registered family of the checkpoint directory ``checkpoint`` (by its ``config.json`` ``model_type``).

    Raises:
        FileNotFoundError: No ``config.json`` there.
        ConfigError: Its ``model_type`` belongs to no registered family (the message lists them).
    """
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {checkpoint}: expected {path}")
    model_type = json.loads(path.read_text()).get("model_type")
    for name in MODEL_FAMILIES.names():
        family = MODEL_FAMILIES.get(name)
        if model_type in family.model_types:
            return family
    known = ", ".join(f"{n} ({', '.join(MODEL_FAMILIES.get(n).model_types)})" for n in MODEL_FAMILIES.names())
    raise ConfigError(
        str(checkpoint), "model_type", f"no model family registered for {model_type!r}; registered: {known}"
    )
