"""The sizes of a tiny checkpoint (:class:`TinyModelSpec`): data that the tiny writer (:mod:`dart.policy.tiny`)
and each family's writer module (:mod:`dart.policy.families`) read, apart from both."""

from __future__ import annotations

from dataclasses import dataclass

from dart.policy.models import MODEL_FAMILIES

IMAGE_SIZE = 224
"""Side of the square screenshot the tiny model sees, pixels (a multiple of 28 and of 32: Qwen2.5-VL's 14 px
patches and Qwen3-VL's 16 px patches, merged 2 x 2, tile it exactly)."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny checkpoint.

    Attributes:
        hidden_size: Text model width.
        num_layers: Text decoder layers.
        num_heads: Text attention heads (head dim = hidden_size / num_heads, must be divisible by 4 for mrope).
        num_kv_heads: Text key/value heads (grouped-query attention).
        intermediate_size: Text MLP width.
        vision_hidden_size: Vision tower width.
        vision_depth: Vision tower blocks.
        vision_heads: Vision attention heads.
        vision_intermediate_size: Vision MLP width.
        bpe_vocab_size: Target size of the BPE vocabulary, before the special tokens.
        image_size: Screenshots are resized to image_size x image_size before the vision tower.
        family: Which registered model family to build (its writer module gives the config and processor).
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vision_hidden_size: int = 64
    vision_depth: int = 1
    vision_heads: int = 2
    vision_intermediate_size: int = 128
    bpe_vocab_size: int = 2048
    image_size: int = IMAGE_SIZE
    family: str = "qwen2.5-vl"

    @property
    def image_tokens(self) -> int:
        """Visual tokens one screenshot becomes in the prompt (one per merged patch)."""
        return (self.image_size // MODEL_FAMILIES.get(self.family).patch_factor) ** 2
