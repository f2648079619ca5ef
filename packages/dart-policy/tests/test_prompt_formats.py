"""Prompt formats: the project's prompt and UI-TARS-1.5's published computer-use prompt, chosen by config."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from dart.policy.action_grammar import format_output, parse_action
from dart.policy.config import PromptConfig
from dart.policy.formats import DART, PROMPT_FORMATS, UI_TARS_15, UI_TARS_15_COMPUTER_USE
from dart.policy.models import QWEN_CHAT
from dart.policy.prompt import HistoryStep, build_prompt, encode_prompt
from dart.policy.screen import ResizeRule, coordinate_scale
from dart.protocol.errors import ConfigError
from dart.protocol.messages import Click, Drag

pytestmark = pytest.mark.unit


def _screens() -> tuple[Image.Image, Image.Image]:
    return Image.new("RGB", (1280, 720), (10, 20, 30)), Image.new("RGB", (1280, 720), (200, 20, 30))


def test_the_ui_tars_prompt_is_the_published_one_with_its_system_message_and_history() -> None:
    older, current = _screens()
    rule = ResizeRule(3136, 12_845_056)
    answer = "Thought: open the menu.\nAction: click(start_box='(640,360)')"
    prompt = build_prompt(
        "Open the File menu.",
        current,
        [HistoryStep(answer, older)],
        max_images=2,
        image_size=rule,
        prompt_format=UI_TARS_15,
    )
    task = UI_TARS_15_COMPUTER_USE.replace("{language}", "English").replace("{instruction}", "Open the File menu.")
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{task}<|im_end|>\n"
        f"<|im_start|>user\n{QWEN_CHAT.image}<|im_end|>\n"
        "<|im_start|>assistant\nThought: open the menu.\nAction: click(start_box='<|box_start|>(640,360)<|box_end|>')"
        "<|im_end|>\n"
        f"<|im_start|>user\n{QWEN_CHAT.image}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt.text == expected
    assert [image.size for image in prompt.images] == [rule.size(1280, 720)] * 2
    assert "## User Instruction\nOpen the File menu.\n" in prompt.text and "Use English in `Thought` part." in task
    assert "fail(" not in task  # UI-TARS-1.5's computer-use space has none


def test_the_dart_prompt_is_unchanged_by_the_format_seam() -> None:
    older, current = _screens()
    prompt = build_prompt("Click OK.", current, [HistoryStep("Action: click(start_box='(5,5)')", older)], max_images=2)
    assert prompt.text.startswith(f"<|im_start|>system\n{DART.system_prompt()}<|im_end|>\n<|im_start|>user\n")
    assert "Action: click(start_box='(5,5)')<|im_end|>" in prompt.text  # shown back as written
    assert "0..1000 grid" in prompt.text


def test_a_demonstration_in_the_ui_tars_format_round_trips_through_its_history() -> None:
    """What the warm start writes in pixels of the shown image parses back to the action, also as shown back."""
    shown = ResizeRule(3136, 12_845_056).size(1920, 1080)
    scale = coordinate_scale("pixels", shown)
    for action in (Click(x=0.25, y=0.75), Drag(x1=0.0, y1=0.5, x2=1.0, y2=0.5)):
        text = format_output("there", action, scale)
        assert parse_action(text, scale).action == action
        assert parse_action(UI_TARS_15.shown_answer(text), scale).action == action
        assert "<|box_start|>" in UI_TARS_15.shown_answer(text)


def test_the_format_is_config_and_decides_the_coordinate_space() -> None:
    assert PromptConfig().format == "dart" and PromptConfig().space() == "grid"
    assert PromptConfig(format="ui-tars-1.5").space() == "pixels"
    assert PromptConfig(coordinates="pixels").space() == "pixels"
    with pytest.raises(ConfigError, match="'grid': the ui-tars-1.5 prompt tells the model pixels only"):
        PromptConfig(format="ui-tars-1.5", coordinates="grid").space()
    with pytest.raises(ValueError, match=r"unknown prompt format 'ui-tars-2'; registered: dart, ui-tars-1.5"):
        PromptConfig(format="ui-tars-2")
    with pytest.raises(ConfigError, match="needs image_size"):
        PromptConfig(format="ui-tars-1.5", image_size=None).space()
    with pytest.raises(ValueError, match="unknown model family 'llava'"):
        PromptConfig(family="llava")
    assert sorted(PROMPT_FORMATS.names()) == ["dart", "ui-tars-1.5"]


def test_the_ui_tars_prompt_encodes_with_the_checkpoints_processor(tiny_checkpoint: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_checkpoint, local_files_only=True)
    older, current = _screens()
    prompt = build_prompt(
        "Open the File menu.",
        current,
        [HistoryStep("Action: click(start_box='(10,10)')", older)],
        max_images=2,
        image_size=224,
        prompt_format=UI_TARS_15,
    )
    encoded = encode_prompt(processor, prompt)
    assert processor.tokenizer.decode(encoded.input_ids).count("<|image_pad|>") == 2 * 64  # 224 px: 64 tokens each
    text = processor.tokenizer.decode(encoded.input_ids).replace("<|image_pad|>" * 64, "<|image_pad|>")
    assert text == prompt.text  # byte-level BPE: the prompt's text is exactly what was tokenized
