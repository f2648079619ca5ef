"""Each model family's checkpoint writers, one module per family, found through its :class:`ModelFamily`.

A family's :class:`~dart.protocol.models.ModelFamily` names its writer module (``family.writer``); the
module gives what ``dart model init`` and the tiny writer need to build a checkpoint of that family with
no download (:class:`FamilyWriter`):

- ``tiny_config(spec, vocab_size, special_ids)``: the transformers config of a tiny spec;
- ``tiny_processor(spec, tokenizer)``: its processor, images sized to the tiny spec's fixed square;
- ``ARCHITECTURES``: the published sizes (:class:`RealArchitecture`), which a writer may cut to fewer layers.

DART's own: :mod:`.qwen2_5_vl` and :mod:`.qwen3_vl`. A third-party family ships one such module and
registers its ``ModelFamily`` (entry-point group ``dart.model_families``) with ``writer`` naming it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol

from dart.protocol.models import ModelFamily
from dart.rollout.errors import ModelInitError
from dart.rollout.model.tiny_spec import TinyModelSpec

QWEN_VOCAB_SIZE = 151936
"""Embedding rows of every Qwen2.5-VL and Qwen3-VL model (the tokenizer uses 151,665 of them)."""

FIRST_SPECIAL_ID = 151643
"""Id of ``<|endoftext|>``, the first special token; the others follow in Qwen's order."""


class RealArchitecture(Protocol):
    """One published model size of a family, as data (see the family modules)."""

    @property
    def name(self) -> str:
        """The name ``dart model init --arch`` takes (``qwen3-vl-8b``)."""
        ...

    @property
    def family(self) -> str:
        """The registered family's name."""
        ...

    @property
    def vocab_size(self) -> int:
        """Embedding rows."""
        ...

    def cut(self, *, layers: int | None = None, vision_blocks: int | None = None) -> RealArchitecture:
        """The same widths with fewer decoder layers and/or vision blocks."""
        ...

    def config(self, special_ids: Mapping[str, int]) -> Any:
        """The transformers config, with the tokenizer's special token ids."""
        ...

    def processor(self, tokenizer: Any) -> Any:
        """The processor with the published image processing settings."""
        ...


class FamilyWriter(Protocol):
    """What a family's writer module provides (module attributes)."""

    ARCHITECTURES: Mapping[str, RealArchitecture]

    def tiny_config(self, spec: TinyModelSpec, vocab_size: int, special_ids: Mapping[str, int]) -> Any:
        """The transformers config of ``spec``'s sizes."""
        ...

    def tiny_processor(self, spec: TinyModelSpec, tokenizer: Any) -> Any:
        """The processor of a tiny checkpoint: images sized to ``spec.image_size`` squared."""
        ...


def writer_of(family: ModelFamily) -> FamilyWriter:
    """The writer module of ``family`` (imported on first use).

    Raises:
        ModelInitError: The module does not import, or lacks a writer function.
    """
    try:
        module = importlib.import_module(family.writer)
    except ImportError as exc:
        raise ModelInitError(
            f"model family {family.name}: writer module {family.writer} does not import: {exc}"
        ) from exc
    missing = [name for name in ("tiny_config", "tiny_processor", "ARCHITECTURES") if not hasattr(module, name)]
    if missing:
        raise ModelInitError(f"model family {family.name}: writer module {family.writer} lacks {', '.join(missing)}")
    return module


def vision_token_ids(special_ids: Mapping[str, int]) -> dict[str, Any]:
    """The config fields naming the Qwen vision tokens, from the tokenizer's special ids."""
    return {
        "image_token_id": special_ids["<|image_pad|>"],
        "video_token_id": special_ids["<|video_pad|>"],
        "vision_start_token_id": special_ids["<|vision_start|>"],
        "vision_end_token_id": special_ids["<|vision_end|>"],
    }


def text_token_ids(special_ids: Mapping[str, int]) -> dict[str, Any]:
    """The language model config fields naming its special tokens."""
    return {
        "bos_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": special_ids["<|im_end|>"],
        "pad_token_id": special_ids["<|endoftext|>"],
    }


def check_count(field: str, value: int, published: int) -> None:
    """Refuse a cut to ``value`` blocks of a ``published`` count."""
    if not 1 <= value <= published:
        raise ModelInitError(f"{field}={value}: must be between 1 and the published {published}")


def rotary_sections(half: int, weights: tuple[int, int, int]) -> tuple[int, int, int]:
    """Split a rotary half-dimension into (temporal, height, width) sections in the ratio ``weights``;
    rounding goes to the temporal section."""
    total = sum(weights)
    h = half * weights[1] // total
    w = half * weights[2] // total
    return half - h - w, h, w
