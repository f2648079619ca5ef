"""Each model family's checkpoint writers, one module per family, found through its :class:`ModelFamily`.

A family's :class:`~dart.policy.models.ModelFamily` names its writer module (``family.writer``); the
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
from dataclasses import dataclass, replace
from typing import Any, Protocol, Self

from dart.policy.errors import ModelInitError
from dart.policy.models import ModelFamily
from dart.policy.tiny_spec import TinyModelSpec

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


@dataclass(frozen=True)
class TowerSizes:
    """The widths every Qwen-VL family's vision transformer has (``vision_config``); a family's tower adds its own.

    Attributes:
        depth: Blocks.
        hidden_size: Block width.
        intermediate_size: MLP width.
        num_heads: Attention heads.
        out_hidden_size: Width of the merged patch embeddings (the language model's hidden size).
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int

    def widths(self) -> dict[str, int]:
        """These fields as ``vision_config`` names them (the same names)."""
        return {
            f: getattr(self, f) for f in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
        }


@dataclass(frozen=True)
class LanguageSizes:
    """The sizes every Qwen-VL family's language model has; a family's ``Architecture`` adds its own.

    Attributes:
        name: The name ``dart model init --arch`` takes.
        hidden_size: Language model width.
        intermediate_size: Language model gated MLP width.
        num_hidden_layers: Decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (grouped-query attention).
        tie_word_embeddings: Whether ``lm_head`` shares the embedding matrix.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool

    def with_layers(self, layers: int | None) -> Self:
        """These sizes with ``layers`` decoder layers (unchanged when None).

        Raises:
            ModelInitError: A count below 1 or above the published one.
        """
        if layers is None:
            return self
        check_count("layers", layers, self.num_hidden_layers)
        return replace(self, num_hidden_layers=layers)


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


def text_config(arch: Any, special_ids: Mapping[str, int], **extra: Any) -> dict[str, Any]:
    """``text_config`` of a Qwen-VL architecture (``arch`` has the fields both families' ``Architecture`` share),
    with the tokenizer's special ids; ``extra`` adds family fields (``head_dim``) and rope settings
    (``mrope_interleaved``) to ``rope_parameters``."""
    rope_extra = {k: extra.pop(k) for k in list(extra) if k.startswith("mrope_")}
    return {
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        **extra,
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": arch.rope_theta,
            "mrope_section": list(arch.mrope_section),
            **rope_extra,
        },
        **text_token_ids(special_ids),
        "tie_word_embeddings": arch.tie_word_embeddings,
    }


def tiny_sizes(spec: TinyModelSpec, vocab_size: int) -> dict[str, Any]:
    """The ``Architecture`` fields every Qwen-VL family's tiny model takes from ``spec`` alike."""
    return {
        "name": "tiny",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
    }


def tiny_tower(spec: TinyModelSpec) -> dict[str, Any]:
    """The ``VisionTower`` fields every Qwen-VL family's tiny model takes from ``spec`` alike."""
    return {
        "depth": spec.vision_depth,
        "hidden_size": spec.vision_hidden_size,
        "intermediate_size": spec.vision_intermediate_size,
        "num_heads": spec.vision_heads,
        "out_hidden_size": spec.hidden_size,
    }
