"""Core attention for megatron-core's local layer spec through ``torch.nn.functional.scaled_dot_product_attention``.

Without Transformer Engine, megatron-core 0.16's local spec has one core attention, ``DotProductAttention``
(its flash-attention code serves inference only): it materializes every layer's scores ``(heads, S, S)`` and
their float32 softmax, kept for the backward pass, memory quadratic in the sequence length in every layer.
:class:`SdpaAttention` takes its place in the spec (same constructor, same ``[s, b, heads * head_dim]``
output, no parameters, so state dicts and checkpoints are unchanged) and lets PyTorch pick a fused kernel
(flash or memory-efficient on CUDA, the flash kernel on CPU) that never holds the full score matrix. This
is also the attention transformers' Qwen2.5-VL runs by default.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional


class SdpaAttention(torch.nn.Module):
    """Causal grouped-query attention of one tensor-parallel rank's heads, as megatron's ``core_attention``.

    Args:
        config: The model's ``TransformerConfig`` (only no-dropout, vanilla-softmax, no-window attention).
        layer_number: Unused (megatron passes it to every core attention).
        attn_mask_type: megatron's ``AttnMaskType``; ``causal`` when no mask is passed at forward.
        softmax_scale: Score scale; ``1 / sqrt(head_dim)`` when None.
        **kwargs: The rest of megatron's core-attention arguments (``attention_type``, ``cp_comm_type``,
            ``pg_collection``), unused: the heads of this rank arrive already split.

    Raises:
        NotImplementedError: The config asks for attention dropout, a non-vanilla softmax or a sliding window.
    """

    def __init__(
        self, config: Any, layer_number: int, attn_mask_type: Any, softmax_scale: float | None = None, **kwargs: Any
    ) -> None:
        from megatron.core.transformer.enums import AttnMaskType

        super().__init__()
        del layer_number, kwargs
        if config.attention_dropout or config.softmax_type != "vanilla" or config.window_size is not None:
            raise NotImplementedError(
                "SdpaAttention supports attention_dropout 0, softmax_type vanilla and no window_size only"
            )
        self.causal = attn_mask_type == AttnMaskType.causal
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """``[sq, b, heads * head_dim]`` from ``query [sq, b, heads, d]`` and ``key``/``value [sk, b, groups, d]``.

        ``attention_mask`` follows megatron (``True`` masks a score out); with None the attention is causal
        (the layer's ``attn_mask_type`` causal, as in the GPT spec) or full. ``attn_mask_type`` at forward is
        ignored, as megatron's ``DotProductAttention`` ignores it.
        """
        del attn_mask_type
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SdpaAttention takes no attention bias and no packed sequences")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        # Grouped-query attention: query head h reads key/value group h // (heads / groups), megatron's order.
        # Repeated here rather than through enable_gqa, which PyTorch marks experimental: the copies are the
        # size of the keys and values, never (S, S).
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        causal = attention_mask is None and self.causal
        keep = None if attention_mask is None else ~attention_mask
        out = functional.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, is_causal=causal, scale=self.softmax_scale
        )
        sq, b = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
