"""Every shipped run config loads and names suites that resolve; the real-checkpoint profile means what it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dart.cli.stack.config import load_run_config, load_tasks, warm_start_on
from dart.cli.stack.run import finalize
from dart.cli.stack.validation import heldout_tasks

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads_and_its_suites_resolve(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # suite files are named relative to the repository, where the README runs them
    config = load_run_config(path)
    assert load_tasks(config)
    if config.validation.enabled:
        assert heldout_tasks(config)


def test_the_real_checkpoint_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    config = load_run_config(ROOT / "examples" / "real-checkpoint.yaml")
    # A checkpoint is named: no sim warm start unless asked for; validation on the run's engines.
    assert config.model.path is not None and not warm_start_on(config)
    assert warm_start_on(
        config.model_copy(update={"warm_start": config.warm_start.model_copy(update={"enabled": True})})
    )
    assert config.validation.enabled and config.validation.engine is None
    prompt = config.rollout.runner.prompt
    assert (prompt.image_size, prompt.format, prompt.space()) == ("model", "ui-tars-1.5", "pixels")
    # The engine config needs nothing dart run fills in; finalize gives it the policy and the pixel bounds.
    policy = tmp_path / "ckpt"
    policy.mkdir()
    (policy / "preprocessor_config.json").write_text(
        json.dumps({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2})
    )
    (policy / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    run = config.model_copy(update={"run": config.run.model_copy(update={"run_dir": tmp_path / "run"})})
    final = finalize(run, policy, "nats://127.0.0.1:4222")
    assert final.rollout.engine is not None and final.rollout.engine.model_path == str(policy)
    runner = final.rollout.runner
    assert (runner.prompt.min_pixels, runner.prompt.max_pixels, runner.prompt.patch_factor) == (3136, 200704, 28)
    assert runner.prompt.family == "qwen2.5-vl"  # from the checkpoint's config.json: its chat frames the prompt
    assert final.train.model_path == str(policy) and final.train.device == "cpu"
