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


def test_a_lora_run_sets_its_vllm_engines_up_for_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    config = load_run_config(ROOT / "examples" / "smoke-vllm-lora.yaml")
    engine = config.rollout.engine
    assert engine is not None and engine.kind == "vllm" and engine.lora is not None  # type: ignore[union-attr]
    assert (engine.lora.max_rank, engine.lora.server_rank) == (8, 8)  # type: ignore[union-attr]
    # A rank vLLM does not take is rounded up to one it does.
    four = load_run_config(ROOT / "examples" / "smoke-vllm-lora.yaml", ["train.lora.rank=4"]).rollout.engine
    assert (four.lora.max_rank, four.lora.server_rank) == (4, 8)  # type: ignore[union-attr]
    # What the servers cannot serve as the trainer computes it is refused when the config is read.
    refusals = {
        "train.lora.adapt_vision=true": "serves without LoRA",
        "rollout.engine.lora.max_rank=4": r"max_rank \(4\) is below train.lora.rank \(8\)",
        "train.lora.rank=600": "vLLM serves LoRA ranks up to 512",
    }
    for override, message in refusals.items():
        with pytest.raises(Exception, match=message):
            load_run_config(ROOT / "examples" / "smoke-vllm-lora.yaml", [override])
    # Without train.lora the servers run without LoRA.
    assert load_run_config(ROOT / "examples" / "smoke-vllm.yaml").rollout.engine.lora is None  # type: ignore[union-attr]
