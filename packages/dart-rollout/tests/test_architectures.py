"""The published Qwen2.5-VL architectures and how they are cut to fewer layers and vision blocks."""

from __future__ import annotations

import pytest

from dart.rollout.errors import ModelInitError
from dart.rollout.model.architectures import ARCHITECTURES, get_architecture

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("blocks", "fullatt"),
    [(32, (7, 15, 23, 31)), (1, (0,)), (2, (1,)), (8, (7,)), (10, (7, 9)), (16, (7, 15))],
)
def test_a_cut_tower_keeps_the_published_full_attention_blocks_and_ends_in_one(
    blocks: int, fullatt: tuple[int, ...]
) -> None:
    arch = get_architecture("qwen2.5-vl-3b").cut(vision_blocks=blocks)
    assert arch.vision.depth == blocks and arch.vision.fullatt_block_indexes == fullatt


def test_a_cut_keeps_every_width() -> None:
    full = get_architecture("qwen2.5-vl-7b")
    cut = full.cut(layers=2, vision_blocks=2)
    assert cut.num_hidden_layers == 2 and full.num_hidden_layers == 28
    assert (cut.hidden_size, cut.intermediate_size, cut.vocab_size) == (3584, 18944, 151936)
    assert cut.vision.hidden_size == 1280 and cut.vision.out_hidden_size == 3584
    assert cut.processing == full.processing


def test_every_size_has_128_wide_heads_and_a_matching_mrope_split() -> None:
    for arch in ARCHITECTURES.values():
        head_dim = arch.hidden_size // arch.num_attention_heads
        assert head_dim == 128 and sum(arch.mrope_section) == head_dim // 2
        assert arch.vision.out_hidden_size == arch.hidden_size


@pytest.mark.parametrize(("layers", "blocks"), [(0, None), (37, None), (None, 33)])
def test_counts_out_of_range_are_refused(layers: int | None, blocks: int | None) -> None:
    with pytest.raises(ModelInitError, match="must be between 1 and the published"):
        get_architecture("qwen2.5-vl-3b").cut(layers=layers, vision_blocks=blocks)
