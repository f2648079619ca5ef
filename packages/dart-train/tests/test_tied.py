"""Tied weights (a head sharing the embedding, as Qwen2.5-VL-3B's): stored once, loaded back whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dart.train.tied import missing_are_tied, with_tied_aliases_copied, without_tied_aliases

pytestmark = pytest.mark.unit


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_tensor_is_written_once_and_loads_back_into_the_tied_model(tmp_path: Path) -> None:
    model = TiedLM()
    state = model.state_dict()
    with pytest.raises(RuntimeError, match="share memory"):  # why the aliases must go
        save_file(state, str(tmp_path / "raw.safetensors"))
    kept = without_tied_aliases(state)
    assert list(kept) == ["embed.weight", "norm.weight", "norm.bias"]
    save_file(kept, str(tmp_path / "w.safetensors"))

    other = TiedLM()
    result = other.load_state_dict(load_file(str(tmp_path / "w.safetensors")), strict=False)
    assert result.missing_keys == ["head.weight"] and missing_are_tied(other, result.missing_keys) == []
    assert torch.equal(other.head.weight, model.embed.weight)
    # A name that is not an alias is reported as really missing.
    assert missing_are_tied(other, ["head.weight", "norm.bias"]) == ["norm.bias"]


def test_untied_copies_are_all_kept() -> None:
    state = {"a": torch.ones(3), "b": torch.ones(3), "c": torch.ones(3)[:2]}
    assert list(without_tied_aliases(state)) == ["a", "b", "c"]
    base = torch.arange(6.0)
    views = {"x": base[:3], "y": base[3:], "z": base[:3]}  # z repeats x; y is another part of the storage
    assert list(without_tied_aliases(views)) == ["x", "y"]


def test_published_weights_keep_every_name_with_aliases_as_copies(tmp_path: Path) -> None:
    model = TiedLM()
    state = with_tied_aliases_copied(model.state_dict())
    assert list(state) == ["embed.weight", "norm.weight", "norm.bias", "head.weight"]
    assert state["head.weight"].data_ptr() != state["embed.weight"].data_ptr()
    assert torch.equal(state["head.weight"], state["embed.weight"])
    save_file(state, str(tmp_path / "w.safetensors"))  # no shared memory left
    assert set(load_file(str(tmp_path / "w.safetensors"))) == set(model.state_dict())
