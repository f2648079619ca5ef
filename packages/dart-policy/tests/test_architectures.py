"""The published Qwen2.5-VL and Qwen3-VL architectures and how they are cut to fewer layers and vision blocks."""

from __future__ import annotations

import pytest

from dart.policy.architectures import architectures, get_architecture
from dart.policy.errors import ModelInitError
from dart.policy.families import FIRST_SPECIAL_ID
from dart.policy.families.qwen2_5_vl import ARCHITECTURES
from dart.policy.families.qwen3_vl import Architecture as Qwen3Architecture
from dart.policy.models import MODEL_FAMILIES
from dart.policy.tiny import SPECIAL_TOKENS

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


PUBLISHED_PARAMETERS = {
    "qwen2.5-vl-3b": 3.75e9,
    "qwen2.5-vl-7b": 8.29e9,
    "qwen2.5-vl-32b": 33.5e9,
    "qwen3-vl-2b": 2.13e9,
    "qwen3-vl-4b": 4.44e9,
    "qwen3-vl-8b": 8.77e9,
    "qwen3-vl-32b": 33.4e9,
}
"""Parameter totals as the model pages state them (rounded to three figures)."""


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_every_published_size_has_its_published_parameter_count(name: str) -> None:
    """The config figures are checked as a whole: the model they build (on the meta device: no memory)
    has the published number of parameters, to the three figures published."""
    import torch

    arch = get_architecture(name)
    ids = {token: FIRST_SPECIAL_ID + i for i, token in enumerate(SPECIAL_TOKENS)}
    with torch.device("meta"):
        model = MODEL_FAMILIES.get(arch.family).model_cls()._from_config(arch.config(ids))
    count = sum(p.numel() for p in model.parameters())
    assert count == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.002), f"{name}: {count:,}"


def test_every_family_lists_its_sizes_in_one_index() -> None:
    assert set(architectures()) == set(PUBLISHED_PARAMETERS)
    with pytest.raises(ModelInitError, match="qwen3-vl-8b"):
        get_architecture("qwen3-vl-9b")


@pytest.mark.parametrize(
    ("layers", "blocks", "deepstack"),
    [(None, None, (8, 16, 24)), (2, 2, (1,)), (4, 10, (8,)), (1, 27, (8,)), (36, 17, (8, 16))],
)
def test_a_cut_qwen3_tower_keeps_the_deepstack_levels_both_sides_still_have(
    layers: int | None, blocks: int | None, deepstack: tuple[int, ...]
) -> None:
    """Each deepstack level is a vision block's features added to one decoder layer's output: a level
    stays while its block and a layer for it remain, and a cut tower keeps at least its last block."""
    arch = get_architecture("qwen3-vl-8b").cut(layers=layers, vision_blocks=blocks)
    assert isinstance(arch, Qwen3Architecture)
    assert arch.vision.deepstack_visual_indexes == deepstack
    assert (arch.hidden_size, arch.head_dim, arch.vision.out_hidden_size) == (4096, 128, 4096)
