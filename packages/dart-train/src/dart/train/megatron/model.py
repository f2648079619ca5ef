"""Qwen2.5-VL with its language model as a megatron-core ``GPTModel`` and its vision tower from transformers.

The language model is a GPTModel from the local (pure megatron-core, no Transformer Engine) layer spec
with RMSNorm, grouped-query attention with qkv bias, SwiGLU and multimodal rope (``mrope_section``).
The vision tower stays the transformers module; its embeddings replace the image-pad tokens' word
embeddings, and the result enters the decoder through ``decoder_input``. The 3-D rope positions come
from the transformers model's own ``get_rope_index``, so the forward pass is the transformers one.

Memory at real size: attention is :class:`~dart.train.megatron.attention.SdpaAttention` in place of the
local spec's ``DotProductAttention`` (which materializes every layer's scores), and the output layer runs
on the positions asked for only (the decoder's hidden states are cut to them first), as the torch
backend's ``logits_to_keep``: a prompt's logits are never made.

CPU support: megatron-core assumes CUDA in a few places. :func:`cpu_compat` avoids them (see
``shared/notes/real-engines-on-cpu.md``): a CPU global memory buffer (megatron's tensor-parallel layers
draw scratch tensors from it), the mrope ``inv_freq`` built on the current device instead of
``torch.cuda.current_device()``, and no logit all-gather inside megatron (``parallel_output=True``;
:func:`gather_vocab` uses ``all_gather`` on a list, which gloo supports).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from dart.train import collectives
from dart.train.batching import ModelInputs
from dart.train.megatron.attention import SdpaAttention
from dart.train.megatron.convert import LMSpec
from dart.train.packing import PackedInputs, block_causal_mask, rope_positions


def import_megatron() -> Any:
    """``megatron.core``, imported with its "Transformer Engine and Apex are not installed" notices silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core
        import megatron.core.models.gpt
        import megatron.core.models.gpt.gpt_layer_specs
        import megatron.core.parallel_state
        import megatron.core.tensor_parallel
    return megatron.core


class _CpuMemoryBuffer:
    """Stands in for megatron's ``GlobalMemoryBuffer``, which allocates on ``torch.cuda.current_device()``."""

    def get_tensor(self, shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None) -> torch.Tensor:
        del name, mem_alloc_context
        return torch.empty(tuple(shape), dtype=dtype)


@contextlib.contextmanager
def cpu_compat(device: torch.device) -> Iterator[None]:
    """Build megatron modules on ``device``: on CPU, ``torch.cuda.current_device()`` answers ``"cpu"`` meanwhile."""
    if device.type != "cpu":
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = original


def install_cpu_memory_buffer() -> None:
    """Replace megatron's global memory buffer (CUDA-allocating) by one that allocates on CPU."""
    mcore = import_megatron()
    mcore.parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)`` with its activations recomputed in the backward pass instead of kept."""
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def build_gpt(hf_config: Any, tp_size: int, dtype: torch.dtype, device: torch.device) -> Any:
    """An uninitialised GPTModel shaped like ``hf_config``'s language model (weights come from conversion)."""
    mcore = import_megatron()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    text = hf_config.text_config
    spec = LMSpec.from_hf_config(hf_config)
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope type {rope.get('rope_type')!r} is not supported by the megatron backend")
    del mcore
    # Everything fused or CUDA-specific is off: the same modules run on CPU (gloo) and GPU.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a notice about CUDA-graph scopes, which are not used here
        config = TransformerConfig(
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            num_attention_heads=spec.num_heads,
            num_query_groups=spec.num_kv_heads,
            kv_channels=spec.head_dim,
            ffn_hidden_size=spec.ffn_size,
            normalization="RMSNorm",
            layernorm_epsilon=float(text.rms_norm_eps),
            add_bias_linear=False,
            add_qkv_bias=True,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=tp_size,
            pipeline_model_parallel_size=1,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            use_cpu_initialization=True,
            perform_initialization=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
            attention_softmax_in_fp32=True,
            mrope_section=list(rope["mrope_section"]),
        )
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer_spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    with cpu_compat(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPTModel's deprecation notice in favour of HybridModel (no mrope there)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=spec.padded_vocab(tp_size),
            max_sequence_length=int(text.max_position_embeddings),
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tied,
            position_embedding_type="mrope",
            rotary_base=int(rope.get("rope_theta", 10000.0)),
        )
    _mark_tensor_parallel(model)
    return model.to(device)


def _mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Set megatron's ``tensor_model_parallel`` attributes on sharded weights.

    Megatron sets them while initialising weights; with ``perform_initialization=False`` (the weights
    come from conversion) it does not, and the TP-aware gradient norm relies on them.
    """
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            sharded = [module.weight, getattr(module, "bias", None)]
            dim = 0
        elif isinstance(module, RowParallelLinear):
            sharded, dim = [module.weight], 1
        else:
            continue
        for param in sharded:
            if isinstance(param, torch.nn.Parameter) and not getattr(param, "tensor_model_parallel", False):
                set_tensor_model_parallel_attributes(param, True, dim, 1)


class _GatherVocab(torch.autograd.Function):
    """All-gather along the last dim over a group; the backward takes this rank's slice back.

    The computation after the gather runs identically on every rank of the group, so each rank's
    slice of the incoming gradient is already the full gradient of its shard (no reduction).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        size = dist.get_world_size(group)
        ctx.rank, ctx.size = dist.get_rank(group), size
        return torch.cat(collectives.all_gather(x, size=size, group=group), dim=-1)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grads[0].chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


def gather_vocab(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Full-vocabulary tensor from vocab-parallel shards (differentiable); identity for a group of one."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    out = _GatherVocab.apply(x, group)
    assert isinstance(out, torch.Tensor)
    return out


class QwenVLMegatron(torch.nn.Module):
    """The policy: ``visual`` (transformers) + ``gpt`` (megatron-core GPTModel, one TP shard).

    Args:
        hf_model: A loaded ``Qwen2_5_VLForConditionalGeneration``; its vision tower and rope-index
            logic are kept, its language model is dropped (the caller converts its weights first).
        gpt: The GPTModel of this TP rank, weights already loaded.
        tp_group: The tensor-parallel process group (None: one rank).
    """

    def __init__(self, hf_model: Any, gpt: Any, tp_group: Any) -> None:
        super().__init__()
        inner = hf_model.model
        self.visual = inner.visual
        self.gpt = gpt
        self.hf_config = hf_model.config
        self.spec = LMSpec.from_hf_config(hf_model.config)
        self.tp_group = tp_group
        # get_rope_index is a method of the transformers model; keep it without registering its modules.
        del inner.language_model
        self._rope_owner = [inner]

    def checkpoint_activations(self) -> None:
        """Recompute each decoder layer's and vision block's activations in the backward pass (non-reentrant
        ``torch.utils.checkpoint``: megatron's own recompute reads CUDA RNG states, which a CPU run lacks; no layer
        here draws random numbers, so there is nothing to replay)."""
        for layer in self.gpt.decoder.layers:
            layer.forward = functools.partial(_checkpointed, layer.forward)
        self.visual.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    @property
    def rope_owner(self) -> Any:
        """The transformers model whose ``get_rope_index`` computes the rope positions (its language model dropped)."""
        return self._rope_owner[0]

    def positions(self, inputs: ModelInputs, device: torch.device) -> torch.Tensor:
        """``(3, 1, S)`` rope positions, as transformers computes them (text-only rows: 0..S-1 on all three)."""
        return rope_positions(self.rope_owner, inputs, device)

    def forward(self, inputs: ModelInputs, start: int, length: int) -> torch.Tensor:
        """Full-vocabulary logits ``(length, V)`` of positions ``start .. start + length - 1`` (padding dropped)."""
        device = next(self.gpt.parameters()).device
        return self._logits(inputs, self.positions(inputs, device), None, slice(start, start + length))

    def forward_packed(self, packed: PackedInputs) -> torch.Tensor:
        """Full-vocabulary logits of a packed row's kept positions (:meth:`PackedInputs.kept_positions`, in row
        order), each row attending to itself only (:func:`~dart.train.packing.block_causal_mask`)."""
        device = next(self.gpt.parameters()).device
        mask = block_causal_mask(packed.lengths, device)
        keep = packed.kept_positions().to(device)
        return self._logits(packed, packed.position_ids[1:].to(device), mask, keep)

    def _logits(
        self, inputs: ModelInputs | PackedInputs, positions: torch.Tensor, mask: torch.Tensor | None, keep: Any
    ) -> torch.Tensor:
        """Logits of the positions ``keep`` (a slice or an index tensor) of one row, causal (``mask`` None) or
        under ``mask`` (``True`` masks a score out)."""
        device = next(self.gpt.parameters()).device
        ids = inputs.input_ids.to(device)
        seq = ids.shape[1]
        emb = self.gpt.embedding(input_ids=ids, position_ids=None)  # [S, 1, H]
        if inputs.pixel_values is not None:
            grid = inputs.image_grid_thw.to(device) if inputs.image_grid_thw is not None else None
            pixels = inputs.pixel_values.to(device=device, dtype=self.visual.dtype)
            image = self.visual(pixels, grid_thw=grid, return_dict=True).pooler_output.to(emb.dtype)
            image_mask = (ids[0] == int(self.hf_config.image_token_id)).view(seq, 1, 1).expand_as(emb)
            emb = emb.masked_scatter(image_mask, image)
        # The decoder's hidden states are cut to the kept positions before megatron's output layer runs.
        cut = self.gpt.decoder.register_forward_hook(lambda _module, _args, hidden: hidden[keep])
        try:
            logits = self.gpt(
                input_ids=ids,
                position_ids=positions,
                attention_mask=mask,  # None: causal, SdpaAttention's default for the GPT spec's causal layers
                decoder_input=emb,
            )  # [1, kept, V_pad / tp]
        finally:
            cut.remove()
        full = gather_vocab(logits[0], self.tp_group)
        # Padded vocabulary rows are zero weights, not tokens: drop their logits before any softmax.
        return full[:, : self.spec.vocab_size]
