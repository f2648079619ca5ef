"""SFT warm start: the NLL of demonstrated responses falls over a few steps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from dart.policy.action_grammar import format_output
from dart.policy.prompt import build_prompt, encode_prompt
from dart.protocol.messages import Click, Type
from dart.train.backend import TorchBackend
from dart.train.config import TrainerConfig
from dart.train.sft import SftSample, sft_step

pytestmark = pytest.mark.unit


def test_sft_loss_decreases_on_demonstrations(tiny_checkpoint: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    backend = TorchBackend.load(TrainerConfig(model_path=str(tiny_checkpoint), lr=3e-3, micro_batch_size=2))
    tokenizer = backend.processor.tokenizer
    demos = []
    for i, action in enumerate([Click(x=0.5, y=0.25), Type(text="hello"), Click(x=0.1, y=0.9)]):
        screen = Image.new("RGB", (320, 240), (80 * i, 40, 160))
        prompt = build_prompt(f"Demo task {i}.", screen)
        encoded = encode_prompt(backend.processor, prompt)
        target = format_output("I see the target.", action) + "<|im_end|>"
        demos.append(SftSample(encoded.input_ids, tokenizer.encode(target), list(prompt.images)))
    losses = [sft_step(backend, demos).loss for _ in range(4)]
    assert losses[-1] < losses[0] * 0.8, losses
    assert backend.step == 4
