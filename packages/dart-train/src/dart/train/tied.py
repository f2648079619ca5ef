"""Tied weights in safetensors files.

A model with tied embeddings (Qwen2.5-VL-3B: ``tie_word_embeddings: true``) has one parameter under two
state-dict names (``model.language_model.embed_tokens.weight`` and ``lm_head.weight``); safetensors
refuses to write two names that share memory. Two ways out, for two readers:

- checkpoints (read back by the trainer) keep the first name of each shared tensor
  (:func:`without_tied_aliases`; the state dict registers the embedding before the head, as Hugging Face
  checkpoints of tied models do) and the loader fills the alias in from the model's own tying
  (:func:`missing_are_tied`);
- published weights (read by the engines) write every name, an alias with its own bytes: vLLM 0.32's
  in-place reload re-materializes the embedding and loads the head only from the file, so without
  them a vLLM server kept serving the previous version's head (log-probs 5.8e-3 off the trainer's on a
  3B-wide checkpoint). The publisher's shard writer (:mod:`dart.train.shards`) streams the alias's bytes
  a second time, holding no copy; :func:`with_tied_aliases_copied` gives the same file through
  safetensors' own ``save_file`` (which refuses shared memory). The price is one more copy of the
  embedding per version in the store (622 MB in bf16 for the 3B).
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


def with_tied_aliases_copied(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every name kept; a name whose tensor shares memory with an earlier one gets a copy."""
    kept = without_tied_aliases(state)
    return {name: tensor if name in kept else tensor.clone() for name, tensor in state.items()}


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
