"""What a vLLM engine checks published weights against: the checkpoint it started from, tied heads included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dart.rollout.engine.vllm_wire import reference_header, safetensors_header

pytestmark = pytest.mark.unit


def _checkpoint(path: Path, *, tied: bool) -> Path:
    """A checkpoint as ``save_pretrained`` writes one: checkpoint names, a tied head stored once."""
    path.mkdir()
    tensors = {"model.embed_tokens.weight": torch.zeros(12, 4), "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4)}
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(12, 4)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied, "text_config": {}}))
    return path


def _published(path: Path) -> Path:
    """Weights as the trainer publishes them: module names, the tied head as its own copy."""
    state = {
        "model.language_model.embed_tokens.weight": torch.ones(12, 4),
        "model.language_model.layers.0.mlp.up_proj.weight": torch.ones(8, 4),
        "lm_head.weight": torch.ones(12, 4),
    }
    save_file(state, str(path))
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_published_weights_match_the_reference_of_a_tied_or_untied_checkpoint(tmp_path: Path, tied: bool) -> None:
    reference = reference_header(_checkpoint(tmp_path / "ckpt", tied=tied))
    published = safetensors_header(_published(tmp_path / "v1.safetensors"))
    assert reference is not None and reference == published


def test_no_reference_without_a_single_weights_file(tmp_path: Path) -> None:
    assert reference_header(tmp_path) is None
