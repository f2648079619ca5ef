"""Qwen2.5-VL's checkpoint writers: the tiny test model's config and processor, and the published sizes.

The published figures are those of the ``config.json`` and ``preprocessor_config.json`` files Qwen publishes
for Qwen2.5-VL-3B/7B/32B-Instruct (UI-TARS-1.5-7B is Qwen2.5-VL-7B's architecture). A checkpoint may be cut
to fewer decoder layers and vision blocks (:meth:`Architecture.cut`); every width, the vocabulary and the
processor settings stay real, so the loading, prompt and weight-transfer code sees the production shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from dart.policy.families import (
    QWEN_VOCAB_SIZE,
    LanguageSizes,
    TowerSizes,
    check_count,
    rotary_sections,
    text_config,
    tiny_sizes,
    tiny_tower,
    vision_token_ids,
)
from dart.policy.models import QWEN2_5_VL
from dart.policy.tiny_spec import TinyModelSpec

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VisionTower(TowerSizes):
    """Qwen2.5-VL's vision transformer (``vision_config``; its MLP is gated).

    Attributes:
        fullatt_block_indexes: Blocks with full attention; the others attend within windows.
        window_size: Window side in pixels.
        patch_size: Patch side in pixels.
        spatial_merge_size: Patches merged per side into one language-model token.
        temporal_patch_size: Frames per patch (a still image is repeated).
        tokens_per_second: Temporal position ids per second of video.
    """

    fullatt_block_indexes: tuple[int, ...]
    window_size: int = 112
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: int = 2


@dataclass(frozen=True)
class ImageProcessing:
    """The image processor's settings (``preprocessor_config.json``).

    Attributes:
        min_pixels: Smallest image area after the aspect-preserving resize, pixels.
        max_pixels: Largest image area after the resize, pixels.
        patch_size: Patch side, pixels.
        merge_size: Patches merged per side.
        temporal_patch_size: Frames per patch.
        image_mean: Per-channel normalization mean (CLIP's).
        image_std: Per-channel normalization standard deviation (CLIP's).
    """

    min_pixels: int = 3136
    max_pixels: int = 12845056
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD


@dataclass(frozen=True)
class Architecture(LanguageSizes):
    """One Qwen2.5-VL model's sizes (head dim = hidden_size / heads = 128 in every size).

    Attributes:
        vision: The vision tower.
        vocab_size: Embedding rows.
        rope_theta: Rotary base.
        mrope_section: Split of the rotary half-dimension into (temporal, height, width).
        max_position_embeddings: Longest context.
        rms_norm_eps: RMSNorm epsilon.
        processing: Image processor settings.
    """

    vision: VisionTower
    vocab_size: int = QWEN_VOCAB_SIZE
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    max_position_embeddings: int = 128000
    rms_norm_eps: float = 1e-6
    processing: ImageProcessing = ImageProcessing()
    family: str = QWEN2_5_VL.name

    def cut(self, *, layers: int | None = None, vision_blocks: int | None = None) -> Architecture:
        """The same widths with fewer decoder layers and/or vision blocks.

        The vision tower keeps the published full-attention blocks that remain and always ends in one
        (the published towers do: block 31 of 32), so a cut tower of 2 or more blocks still runs
        both window and full attention. E.g. 2 blocks: ``(1,)``; 10 blocks: ``(7, 9)``.

        Raises:
            ModelInitError: A count below 1 or above the published one.
        """
        arch = self.with_layers(layers)
        if vision_blocks is not None:
            check_count("vision_blocks", vision_blocks, self.vision.depth)
            kept = [i for i in self.vision.fullatt_block_indexes if i < vision_blocks]
            if vision_blocks - 1 not in kept:
                kept.append(vision_blocks - 1)
            arch = replace(arch, vision=replace(self.vision, depth=vision_blocks, fullatt_block_indexes=tuple(kept)))
        return arch

    def text_config(self, special_ids: Mapping[str, int]) -> dict[str, Any]:
        """``text_config`` of :class:`transformers.Qwen2_5_VLConfig`, with the tokenizer's special ids."""
        return text_config(self, special_ids)

    def config(self, special_ids: Mapping[str, int]) -> Any:
        """The :class:`transformers.Qwen2_5_VLConfig`, with the tokenizer's special ids."""
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig(
            text_config=self.text_config(special_ids),
            vision_config=self.vision_config(),
            **vision_token_ids(special_ids),
            tie_word_embeddings=self.tie_word_embeddings,
        )

    def processor(self, tokenizer: Any) -> Any:
        """The processor with the published image processor settings and ``tokenizer``."""
        p = self.processing
        return _processor(tokenizer, p.min_pixels, p.max_pixels, p.patch_size, list(p.image_mean), list(p.image_std))

    def vision_config(self) -> dict[str, Any]:
        """``vision_config`` of :class:`transformers.Qwen2_5_VLConfig`."""
        v = self.vision
        return {
            **v.widths(),
            "patch_size": v.patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "temporal_patch_size": v.temporal_patch_size,
            "window_size": v.window_size,
            "fullatt_block_indexes": list(v.fullatt_block_indexes),
            "tokens_per_second": v.tokens_per_second,
            "hidden_act": "silu",
        }


_FULLATT = (7, 15, 23, 31)

ARCHITECTURES: dict[str, Architecture] = {
    "qwen2.5-vl-3b": Architecture(
        name="qwen2.5-vl-3b",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        vision=VisionTower(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=2048,
            fullatt_block_indexes=_FULLATT,
        ),  # fmt: skip
    ),
    "qwen2.5-vl-7b": Architecture(
        name="qwen2.5-vl-7b",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        vision=VisionTower(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=3584,
            fullatt_block_indexes=_FULLATT,
        ),  # fmt: skip
    ),
    "qwen2.5-vl-32b": Architecture(
        name="qwen2.5-vl-32b",
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        vision=VisionTower(
            depth=32,
            hidden_size=1280,
            intermediate_size=3456,
            num_heads=16,
            out_hidden_size=5120,
            fullatt_block_indexes=_FULLATT,
        ),  # fmt: skip
    ),
}
"""The published Qwen2.5-VL sizes by name."""


def tiny_config(spec: TinyModelSpec, vocab_size: int, ids: Mapping[str, int]) -> Any:
    """The Qwen2.5-VL config of ``spec``'s sizes, with the special token ids of its tokenizer: full attention
    in every vision block, rotary sections in Qwen's 2:3:3 ratio."""
    head_dim = spec.hidden_size // spec.num_heads
    tiny = Architecture(
        **tiny_sizes(spec, vocab_size),
        vision=VisionTower(**tiny_tower(spec), fullatt_block_indexes=tuple(range(spec.vision_depth))),
        mrope_section=rotary_sections(head_dim // 2, (2, 3, 3)),
    )
    return tiny.config(ids)


def tiny_processor(spec: TinyModelSpec, tokenizer: Any) -> Any:
    """The tiny checkpoint's processor: images sized to exactly ``spec.image_size`` squared."""
    pixels = spec.image_size * spec.image_size
    return _processor(tokenizer, pixels, pixels, QWEN2_5_VL.patch_size, None, None)


def _processor(
    tokenizer: Any,
    min_pixels: int,
    max_pixels: int,
    patch_size: int,
    mean: list[float] | None,
    std: list[float] | None,
) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from dart.policy.tiny import CHAT_TEMPLATE

    settings: dict[str, Any] = {"min_pixels": min_pixels, "max_pixels": max_pixels, "patch_size": patch_size}
    if mean is not None and std is not None:
        settings.update(temporal_patch_size=2, merge_size=QWEN2_5_VL.merge_size, image_mean=mean, image_std=std)
    video = {k: v for k, v in settings.items() if k != "patch_size"} if mean is None else settings
    return QWEN2_5_VL.processor_cls()(
        image_processor=Qwen2VLImageProcessorPil(**settings),
        tokenizer=tokenizer,
        # The processor requires a video processor even though DART only sends screenshots.
        video_processor=Qwen2VLVideoProcessor(**video),
        chat_template=CHAT_TEMPLATE,
    )
