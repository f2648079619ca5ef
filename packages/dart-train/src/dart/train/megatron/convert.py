"""Conversion of Qwen2.5-VL language-model weights between Hugging Face and megatron-core layouts.

Pure tensor code (no megatron import), exact in both directions for any tensor-parallel size that
divides the number of key/value heads:

- ``q_proj``/``k_proj``/``v_proj`` (weights and biases) become one ``linear_qkv`` whose rows are
  grouped per key/value head as ``[q heads of the group, k, v]``; TP rank r holds groups
  ``r * G/tp .. (r+1) * G/tp - 1``.
- ``gate_proj`` and ``up_proj`` stack into ``linear_fc1`` *per TP rank*: rank r holds
  ``cat(gate[rows of r], up[rows of r])`` (megatron's SwiGLU splits its local output in two halves).
- ``o_proj`` / ``down_proj`` split by input columns (row-parallel); embeddings and the output layer
  split by vocabulary rows, the vocabulary zero-padded to a multiple of tp (the padded logits are
  dropped before any log-softmax, see :mod:`dart.train.megatron.model`).
- RMSNorm weights are replicated.

Usage::

    spec = LMSpec.from_hf_config(model.config)
    shard = hf_to_megatron(hf_state, spec, tp_rank=0, tp_size=2)
    hf_again = megatron_to_hf([shard0, shard1], spec)   # bitwise equal to hf_state's language model

The Hugging Face names are those of ``Qwen2_5_VLForConditionalGeneration.state_dict()`` in
transformers 5 (``model.language_model.*``, ``lm_head.weight``); the vision tower (``model.visual.*``)
is not converted: it stays a transformers module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dart.train.errors import ParallelismError

HF_LM = "model.language_model."
HF_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class LMSpec:
    """Shape of the Qwen2.5-VL language model that the conversion needs.

    Attributes:
        num_layers: Decoder layers.
        hidden_size: Model width.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (query groups).
        head_dim: Width of one head.
        ffn_size: MLP width.
        vocab_size: Rows of the embedding in the Hugging Face checkpoint.
        tied: Whether ``lm_head`` shares the embedding (``tie_word_embeddings``).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    tied: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> LMSpec:
        """Spec of a ``Qwen2_5_VLConfig`` (its ``text_config``)."""
        text = getattr(config, "text_config", config)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(
            num_layers=int(text.num_hidden_layers),
            hidden_size=int(text.hidden_size),
            num_heads=int(text.num_attention_heads),
            num_kv_heads=int(text.num_key_value_heads),
            head_dim=int(head_dim),
            ffn_size=int(text.intermediate_size),
            vocab_size=int(text.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def padded_vocab(self, tp_size: int) -> int:
        """Vocabulary rows after zero-padding to a multiple of ``tp_size``."""
        return -(-self.vocab_size // tp_size) * tp_size

    def check_tp(self, tp_size: int) -> None:
        """Raise :class:`ParallelismError` unless ``tp_size`` splits heads, groups and the MLP evenly."""
        if tp_size < 1:
            raise ParallelismError(f"tensor_parallel_size must be >= 1, got {tp_size}")
        for what, n in (("key/value heads", self.num_kv_heads), ("attention heads", self.num_heads)):
            if n % tp_size:
                raise ParallelismError(f"tensor_parallel_size {tp_size} does not divide the model's {n} {what}")
        if self.ffn_size % tp_size:
            raise ParallelismError(f"tensor_parallel_size {tp_size} does not divide the MLP width {self.ffn_size}")


def _rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=0)[rank]


def _cols(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=1)[rank]


def _pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], dim=0)


def _qkv_shard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LMSpec, rank: int, tp: int) -> torch.Tensor:
    """Megatron's grouped ``linear_qkv`` rows (weight or bias) of one TP rank."""
    groups, per = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
    d = spec.head_dim
    tail = q.shape[1:]
    q = q.reshape(groups, per * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    fused = torch.cat([q, k, v], dim=1)  # (groups, (per + 2) * d, ...)
    return _rows(fused, rank, tp).reshape(-1, *tail)


def _qkv_unshard(shards: Sequence[torch.Tensor], spec: LMSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads
    d = spec.head_dim
    tail = shards[0].shape[1:]
    fused = torch.cat(list(shards), dim=0).reshape(groups, (per + 2) * d, *tail)
    q, k, v = torch.split(fused, [per * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], spec: LMSpec, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """The GPTModel parameters of TP rank ``tp_rank`` from a Hugging Face Qwen2.5-VL state dict.

    Returns contiguous clones keyed by GPTModel parameter names (``embedding.word_embeddings.weight``,
    ``decoder.layers.{i}.self_attention.linear_qkv.weight``, ...).

    Raises:
        ParallelismError: ``tp_size`` does not split the model evenly.
        KeyError: A language-model tensor is missing from ``hf``.
    """
    spec.check_tp(tp_size)
    r, tp = tp_rank, tp_size
    vocab = spec.padded_vocab(tp)
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": _rows(_pad_vocab(hf[HF_LM + "embed_tokens.weight"], vocab), r, tp),
        "decoder.final_layernorm.weight": hf[HF_LM + "norm.weight"],
    }
    if not spec.tied:
        out["output_layer.weight"] = _rows(_pad_vocab(hf[HF_HEAD], vocab), r, tp)
    for i in range(spec.num_layers):
        src, dst = f"{HF_LM}layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        for kind in ("weight", "bias"):
            q, k, v = (hf[f"{attn}{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}self_attention.linear_qkv.{kind}"] = _qkv_shard(q, k, v, spec, r, tp)
        out[dst + "self_attention.linear_proj.weight"] = _cols(hf[attn + "o_proj.weight"], r, tp)
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([_rows(gate, r, tp), _rows(up, r, tp)], dim=0)
        out[dst + "mlp.linear_fc2.weight"] = _cols(hf[src + "mlp.down_proj.weight"], r, tp)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def megatron_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], spec: LMSpec) -> dict[str, torch.Tensor]:
    """The Hugging Face language-model tensors (and ``lm_head``) from the GPTModel parameters of every TP rank.

    ``shards[r]`` is rank r's dict as :func:`hf_to_megatron` returns it (or the same names taken from
    the live module, gradients included: the mapping is linear). The vocabulary padding is removed.

    Raises:
        ParallelismError: The shards do not fit the spec.
    """
    tp = len(shards)
    spec.check_tp(tp)

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    embed = cat("embedding.word_embeddings.weight", 0)
    if embed.shape[0] != spec.padded_vocab(tp):
        raise ParallelismError(f"embedding has {embed.shape[0]} rows, expected {spec.padded_vocab(tp)} at TP={tp}")
    out: dict[str, torch.Tensor] = {
        HF_LM + "embed_tokens.weight": embed[: spec.vocab_size],
        HF_LM + "norm.weight": shards[0]["decoder.final_layernorm.weight"],
    }
    out[HF_HEAD] = out[HF_LM + "embed_tokens.weight"] if spec.tied else cat("output_layer.weight", 0)[: spec.vocab_size]
    for i in range(spec.num_layers):
        src, dst = f"decoder.layers.{i}.", f"{HF_LM}layers.{i}."
        attn = dst + "self_attn."
        for kind in ("weight", "bias"):
            q, k, v = _qkv_unshard([s[f"{src}self_attention.linear_qkv.{kind}"] for s in shards], spec)
            out[f"{attn}q_proj.{kind}"], out[f"{attn}k_proj.{kind}"], out[f"{attn}v_proj.{kind}"] = q, k, v
        out[attn + "o_proj.weight"] = cat(src + "self_attention.linear_proj.weight", 1)
        out[dst + "input_layernorm.weight"] = shards[0][src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = shards[0][src + "pre_mlp_layernorm.weight"]
        halves = [s[src + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        out[dst + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves], dim=0)
        out[dst + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves], dim=0)
        out[dst + "mlp.down_proj.weight"] = cat(src + "mlp.linear_fc2.weight", 1)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def is_language_model_key(name: str) -> bool:
    """Whether a Hugging Face state-dict name belongs to the converted language model (else: the vision tower)."""
    return name.startswith(HF_LM) or name == HF_HEAD
