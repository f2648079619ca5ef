"""The runner's config: the prompt's settings resolved against the checkpoint, and where old settings moved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dart.policy.config import PromptConfig
from dart.policy.screen import ResizeRule
from dart.protocol.errors import ConfigError
from dart.rollout.service.config import RunnerConfig, resolve_runner

pytestmark = pytest.mark.unit


def test_resolve_runner_fills_the_checkpoint_bounds_and_pixels_need_a_known_image(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    runner = resolve_runner(RunnerConfig(prompt=PromptConfig(image_size="model", max_pixels=401_408)), tmp_path)
    prompt = runner.prompt
    assert (prompt.min_pixels, prompt.max_pixels, prompt.patch_factor) == (3136, 401_408, 28)
    assert prompt.family == "qwen2.5-vl"  # the checkpoint's, which frames the chat
    assert prompt.image_sizing() == ResizeRule(3136, 401_408, 28)
    with pytest.raises(ConfigError, match="min_pixels and max_pixels"):
        PromptConfig(image_size="model").image_sizing()
    assert PromptConfig(image_size=224).resolved(None).image_sizing() == 224
    with pytest.raises(ValueError, match="pixels"):
        PromptConfig(image_size=None, coordinates="pixels")


def test_prompt_settings_given_on_the_runner_say_where_they_moved() -> None:
    with pytest.raises(ValueError, match=r"max_images moved to rollout.runner.prompt"):
        RunnerConfig.model_validate({"pool": "sim", "max_images": 2})
