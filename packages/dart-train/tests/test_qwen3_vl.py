"""Qwen3-VL beside Qwen2.5-VL: a tiny random Qwen3-VL (deepstack vision, interleaved 3-D rope, 16 px patches)
written with no download and loaded by the trainer's loaders; the megatron backend refuses it at start, naming
why (served by the hf engine and recomputed by the torch backend: tests/engine_and_trainer/test_qwen3_vl_engines.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dart.policy.models import family_of
from dart.policy.tiny import write_tiny_checkpoint
from dart.policy.tiny_spec import TinyModelSpec
from dart.train.config import TrainerConfig
from dart.train.errors import TrainerError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3") / "ckpt"
    write_tiny_checkpoint(path, seed=3, spec=TinyModelSpec(family="qwen3-vl"))
    return path


def test_the_tiny_writer_builds_a_qwen3_vl_the_loaders_recognize(qwen3_checkpoint: Path) -> None:
    manifest = json.loads((qwen3_checkpoint / "dart_tiny_manifest.json").read_text())
    assert manifest["architecture"] == "Qwen3VLForConditionalGeneration"
    assert manifest["image_tokens"] == 49  # 224 px / 16 px patches = 14 a side, merged 2 x 2
    config = json.loads((qwen3_checkpoint / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and config["vision_config"]["deepstack_visual_indexes"] == [0]
    assert config["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    assert family_of(qwen3_checkpoint).name == "qwen3-vl"


def test_the_megatron_backend_refuses_qwen3_vl_naming_the_family(qwen3_checkpoint: Path) -> None:
    from dart.train.megatron import MegatronBackend

    config = TrainerConfig(model_path=str(qwen3_checkpoint), backend={"kind": "megatron"})
    with pytest.raises(TrainerError, match="converts qwen2.5-vl checkpoints only; .* is qwen3-vl"):
        MegatronBackend.create(config)
