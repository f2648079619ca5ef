"""Qwen3-VL's (dense) checkpoint writers: the tiny test model's config and processor, and the published sizes.

The published figures are those of the ``config.json`` and ``preprocessor_config.json`` files of
Qwen3-VL-2B/4B/8B/32B-Instruct: 128-wide heads with an explicit ``head_dim``, interleaved 3-D rotary
sections ``[24, 20, 20]`` with base 5,000,000, a vision tower of 16 px patches with learned position
embeddings on a 48 x 48 grid (2,304), and deepstack: the features of three vision blocks join the first
three decoder layers' outputs. The image processor normalizes with mean and std 0.5 and sizes an image's
area within 65,536 .. 16,777,216 pixels, each side a multiple of 32.
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
from dart.policy.models import QWEN3_VL
from dart.policy.tiny_spec import TinyModelSpec

MIN_PIXELS = 65536
"""Smallest image area after the resize, as the published processor says (``size.shortest_edge``)."""
MAX_PIXELS = 16777216
"""Largest image area after the resize (``size.longest_edge``)."""
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class VisionTower(TowerSizes):
    """Qwen3-VL's vision transformer (``vision_config``).

    Attributes:
        deepstack_visual_indexes: Blocks whose features are added to the first decoder layers' outputs.
        num_position_embeddings: Learned position embeddings (a square grid, interpolated to the image).
    """

    deepstack_visual_indexes: tuple[int, ...]
    num_position_embeddings: int = 2304


@dataclass(frozen=True)
class Architecture(LanguageSizes):
    """One Qwen3-VL (dense) model's sizes.

    Attributes:
        vision: The vision tower.
        head_dim: Attention head width (explicit: ``hidden_size / heads`` is not 128 in every size).
        vocab_size: Embedding rows.
        rope_theta: Rotary base.
        mrope_section: Interleaved split of the rotary half-dimension into (temporal, height, width).
        max_position_embeddings: Longest context.
        rms_norm_eps: RMSNorm epsilon.
        family: The registered family.
    """

    vision: VisionTower
    head_dim: int = 128
    vocab_size: int = QWEN_VOCAB_SIZE
    rope_theta: float = 5000000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    family: str = QWEN3_VL.name

    def cut(self, *, layers: int | None = None, vision_blocks: int | None = None) -> Architecture:
        """The same widths with fewer decoder layers and/or vision blocks.

        Deepstack levels whose vision block is cut away go; when none remains, the last kept block is one
        (a cut tower still runs the deepstack path). Each remaining level adds to one decoder layer, so
        they are at most ``layers``.

        Raises:
            ModelInitError: A count below 1 or above the published one.
        """
        arch = self.with_layers(layers)
        if vision_blocks is not None:
            check_count("vision_blocks", vision_blocks, self.vision.depth)
            kept = [i for i in self.vision.deepstack_visual_indexes if i < vision_blocks] or [vision_blocks - 1]
            arch = replace(arch, vision=replace(arch.vision, depth=vision_blocks, deepstack_visual_indexes=tuple(kept)))
        levels = arch.vision.deepstack_visual_indexes[: arch.num_hidden_layers]
        return replace(arch, vision=replace(arch.vision, deepstack_visual_indexes=levels))

    def config(self, special_ids: Mapping[str, int]) -> Any:
        """The :class:`transformers.Qwen3VLConfig`, with the tokenizer's special ids."""
        from transformers import Qwen3VLConfig

        v = self.vision
        return Qwen3VLConfig(
            text_config=text_config(self, special_ids, head_dim=self.head_dim, mrope_interleaved=True),
            vision_config={
                **v.widths(),
                "patch_size": QWEN3_VL.patch_size,
                "spatial_merge_size": QWEN3_VL.merge_size,
                "temporal_patch_size": 2,
                "num_position_embeddings": v.num_position_embeddings,
                "deepstack_visual_indexes": list(v.deepstack_visual_indexes),
                "hidden_act": "gelu_pytorch_tanh",
            },
            **vision_token_ids(special_ids),
            tie_word_embeddings=self.tie_word_embeddings,
        )

    def processor(self, tokenizer: Any) -> Any:
        """The processor with the published image processor settings and ``tokenizer``."""
        return _processor(tokenizer, MIN_PIXELS, MAX_PIXELS, normalize=True)


_SMALL_TOWER = {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16}
_LARGE_TOWER = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16}

ARCHITECTURES: dict[str, Architecture] = {
    "qwen3-vl-2b": Architecture(
        name="qwen3-vl-2b",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        vision=VisionTower(**_SMALL_TOWER, out_hidden_size=2048, deepstack_visual_indexes=(5, 11, 17)),
    ),
    "qwen3-vl-4b": Architecture(
        name="qwen3-vl-4b",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        vision=VisionTower(**_SMALL_TOWER, out_hidden_size=2560, deepstack_visual_indexes=(5, 11, 17)),
    ),
    "qwen3-vl-8b": Architecture(
        name="qwen3-vl-8b",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        vision=VisionTower(**_LARGE_TOWER, out_hidden_size=4096, deepstack_visual_indexes=(8, 16, 24)),
    ),
    "qwen3-vl-32b": Architecture(
        name="qwen3-vl-32b",
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        vision=VisionTower(**_LARGE_TOWER, out_hidden_size=5120, deepstack_visual_indexes=(8, 16, 24)),
    ),
}
"""The published Qwen3-VL dense sizes by name."""


def tiny_config(spec: TinyModelSpec, vocab_size: int, ids: Mapping[str, int]) -> Any:
    """The Qwen3-VL config of ``spec``'s sizes: explicit head dim, interleaved rotary sections in the published
    6:5:5 ratio, one deepstack level (the first block's features join the first decoder layer's output), and
    64 learned vision position embeddings (an 8 x 8 grid, interpolated to the image's)."""
    head_dim = spec.hidden_size // spec.num_heads
    tiny = Architecture(
        **tiny_sizes(spec, vocab_size),
        vision=VisionTower(**tiny_tower(spec), deepstack_visual_indexes=(0,), num_position_embeddings=64),
        head_dim=head_dim,
        mrope_section=rotary_sections(head_dim // 2, (6, 5, 5)),
    )
    return tiny.config(ids)


def tiny_processor(spec: TinyModelSpec, tokenizer: Any) -> Any:
    """The tiny checkpoint's processor: images sized to exactly ``spec.image_size`` squared."""
    pixels = spec.image_size * spec.image_size
    return _processor(tokenizer, pixels, pixels, normalize=False)


def _processor(tokenizer: Any, min_pixels: int, max_pixels: int, *, normalize: bool) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from dart.policy.tiny import CHAT_TEMPLATE

    patch = QWEN3_VL.patch_size
    image: dict[str, Any] = {"min_pixels": min_pixels, "max_pixels": max_pixels, "patch_size": patch}
    if normalize:
        image.update(merge_size=QWEN3_VL.merge_size, image_mean=list(IMAGE_MEAN), image_std=list(IMAGE_STD))
    # The processor requires a video processor even though DART only sends screenshots.
    video = Qwen3VLVideoProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=patch)
    return QWEN3_VL.processor_cls()(
        image_processor=Qwen2VLImageProcessorPil(**image),
        tokenizer=tokenizer,
        video_processor=video,
        chat_template=CHAT_TEMPLATE,
    )
