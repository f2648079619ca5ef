"""The tiny Qwen2.5-VL checkpoint: written and loaded offline, lossless tokenizer, prompt image tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from dart.policy.action_grammar import format_output, parse_action
from dart.policy.loading import load_policy
from dart.policy.prompt import IMAGE_PLACEHOLDER, HistoryStep, build_prompt, encode_prompt
from dart.policy.tiny import MANIFEST_NAME, write_tiny_checkpoint
from dart.protocol.messages import Click, Drag, Finished, Hotkey, Scroll, ScrollDirection, Type, Wait

pytestmark = pytest.mark.unit


def test_checkpoint_loads_offline_with_manifest(tiny_checkpoint: Path) -> None:
    model, processor = load_policy(tiny_checkpoint)
    manifest = json.loads((tiny_checkpoint / MANIFEST_NAME).read_text())
    assert type(model).__name__ == manifest["architecture"] == "Qwen2_5_VLForConditionalGeneration"
    assert manifest["num_parameters"] == sum(p.numel() for p in model.parameters()) < 2_000_000
    assert model.config.text_config.vocab_size == len(processor.tokenizer) == manifest["vocab_size"]
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")


def test_same_seed_same_weights(tiny_checkpoint: Path, tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, seed=0)
    assert (tmp_path / "model.safetensors").read_bytes() == (tiny_checkpoint / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "action",
    [
        Click(x=0.912, y=0.871),
        Drag(x1=0.0, y1=1.0, x2=0.5, y2=0.25),
        Hotkey(keys=("ctrl", "c")),
        Type(text="héllo wörld 'quoted'\n"),
        Scroll(x=0.5, y=0.5, direction=ScrollDirection.UP),
        Wait(),
        Finished(content="done"),
    ],
)
def test_tokenizer_round_trips_action_text(tiny_checkpoint: Path, action: object) -> None:
    _, processor = load_policy(tiny_checkpoint)
    text = format_output("Click the OK button at the bottom.", action)  # type: ignore[arg-type]
    ids = processor.tokenizer.encode(text, add_special_tokens=False)
    decoded = processor.tokenizer.decode(ids)
    assert decoded == text
    assert parse_action(decoded).action == action


def test_prompt_shows_last_k_screenshots_and_all_actions(tiny_checkpoint: Path) -> None:
    _, processor = load_policy(tiny_checkpoint)
    screen = Image.new("RGB", (320, 240), (30, 60, 90))
    history = [HistoryStep(f"Action: click(start_box='({i},{i})')", screen) for i in range(3)]
    prompt = build_prompt("Click the OK button.", screen, history, max_images=2)
    assert prompt.text.count(IMAGE_PLACEHOLDER) == len(prompt.images) == 2
    assert all(f"click(start_box='({i},{i})')" in prompt.text for i in range(3))
    assert prompt.text.endswith("<|im_start|>assistant\n")
    encoded = encode_prompt(processor, prompt)
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert encoded.input_ids.count(image_id) == 2 * 64  # 224x224, patch 14, merge 2
    assert tuple(encoded.image_grid_thw.shape) == (2, 3)
