"""Tied weights in safetensors files: each tensor stored once, under the name its model registers first.

A model with tied embeddings (Qwen2.5-VL-3B: ``tie_word_embeddings: true``) has one parameter under two
state-dict names (``model.language_model.embed_tokens.weight`` and ``lm_head.weight``). safetensors
refuses to write two names that share memory, and writing a copy would store the 622 MB embedding twice
per version. Published weights and checkpoints therefore keep the first name of each shared tensor (the
state dict registers the embedding before the head, as Hugging Face checkpoints of tied models do), and
loaders fill the alias back in from the model's own tying (:func:`missing_are_tied`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


def without_tied_aliases(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` keeping, of the names whose tensors share memory, the first in ``state``'s order."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names of ``model`` that repeat a parameter registered under an earlier name."""
    first: dict[int, str] = {}
    aliases = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases.add(name)
        else:
            first[id(tensor)] = name
    return aliases


def missing_are_tied(model: torch.nn.Module, missing: Iterable[str]) -> list[str]:
    """The names of ``missing`` that are not tied aliases of ``model`` (so really missing)."""
    aliases = tied_aliases(model)
    return sorted(set(missing) - aliases)
