"""The megatron backend's core attention (``SdpaAttention``) against attention written out by hand."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from dart.train.megatron.attention import SdpaAttention
from dart.train.megatron.model import import_megatron


def _attention(heads: int, groups: int, head_dim: int, dropout: float = 0.0) -> SdpaAttention:
    import_megatron()
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a notice about CUDA-graph scopes, which are not used here
        config = TransformerConfig(
            num_layers=1,
            hidden_size=heads * head_dim,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=head_dim,
            attention_dropout=dropout,
            use_cpu_initialization=True,
        )
    return SdpaAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)


@pytest.mark.unit
def test_causal_grouped_query_attention_in_megatrons_layout_matches_the_scores_written_out() -> None:
    seq, batch, heads, groups, head_dim = 7, 2, 4, 2, 8
    attention = _attention(heads, groups, head_dim)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq, batch, heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(seq, batch, groups, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(seq, batch, groups, head_dim, generator=gen, dtype=torch.float64)
    out = attention(q.float(), k.float(), v.float(), None)

    # Query head h reads key/value group h // (heads / groups); position i sees positions 0..i.
    kk, vv = k.repeat_interleave(heads // groups, dim=2), v.repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, kk) / math.sqrt(head_dim)
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    expected = torch.einsum("bhqk,kbhd->qbhd", probs, vv).reshape(seq, batch, heads * head_dim)
    assert out.shape == (seq, batch, heads * head_dim) and out.dtype == torch.float32
    assert float((out.double() - expected).abs().max()) < 1e-5

    # An explicit mask in megatron's convention (True masks a score out) gives the same.
    masked = attention(q.float(), k.float(), v.float(), future.view(1, 1, seq, seq))
    assert float((masked - out).abs().max()) < 1e-6


@pytest.mark.unit
def test_attention_dropout_is_refused_at_build() -> None:
    with pytest.raises(NotImplementedError, match="attention_dropout 0"):
        _attention(4, 2, 8, dropout=0.1)
