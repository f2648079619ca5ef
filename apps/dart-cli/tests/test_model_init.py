"""`dart model init` writes real-architecture Qwen2.5-VL checkpoints that load like downloaded ones."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _init(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dart.cli", "model", "init", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def qwen3b_cut(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Qwen2.5-VL-3B cut to 2 decoder layers and 2 vision blocks, bf16 (0.54 B parameters, 1.1 GB)."""
    path = tmp_path_factory.mktemp("qwen3b") / "ckpt"
    proc = _init("--arch", "qwen2.5-vl-3b", "--layers", "2", "--vision-blocks", "2", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["architecture"] == "qwen2.5-vl-3b" and summary["dtype"] == "bfloat16"
    yield path
    shutil.rmtree(path, ignore_errors=True)  # 1 GB: freed with the module, not at the end of the session


def test_the_cut_3b_checkpoint_keeps_every_real_width(qwen3b_cut: Path) -> None:
    import torch
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen3b_cut, local_files_only=True)
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_attention_heads, text.num_key_value_heads) == (
        2048,
        11008,
        16,
        2,
    )
    assert text.num_hidden_layers == 2 and len(model.model.language_model.layers) == 2
    assert text.vocab_size == 151936 and model.lm_head.weight.shape == (151936, 2048)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and text.rope_parameters["rope_theta"] == 1e6
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads) == (2, 1280, 3420, 16)
    assert (vision.out_hidden_size, vision.window_size, vision.fullatt_block_indexes) == (2048, 112, [1])
    assert next(model.parameters()).dtype == torch.bfloat16
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())

    processor = AutoProcessor.from_pretrained(qwen3b_cut, local_files_only=True)
    tok = processor.tokenizer
    qwen_ids = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
    qwen_ids |= {"<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655}
    assert {t: tok.convert_tokens_to_ids(t) for t in qwen_ids} == qwen_ids
    assert model.config.image_token_id == 151655
    action = "Thought: the OK button\nAction: click(start_box='(912,871)')"
    assert tok.decode(tok.encode(action)) == action

    # Real patching: a 1920x1080 screenshot is resized within min/max pixels to 1932x1092 -> 69x39 tokens.
    from PIL import Image

    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Click OK.<|im_end|>\n"
    inputs = processor(text=[prompt], images=[Image.new("RGB", (1920, 1080), (9, 99, 199))], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 78, 138]]
    assert int((inputs["input_ids"] == 151655).sum()) == 2691

    small = processor(text=[prompt], images=[Image.new("RGB", (448, 448), (9, 99, 199))], return_tensors="pt")
    with torch.inference_mode():
        logits = model(**small).logits
    assert logits.shape[-1] == 151936 and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--arch", "qwen2.5-vl-9b"], "unknown architecture 'qwen2.5-vl-9b'"),
        (["--arch", "qwen2.5-vl-3b", "--layers", "37"], "layers=37"),
        (["--arch", "qwen2.5-vl-7b", "--vision-blocks", "0"], "vision_blocks=0"),
        (["--arch", "tiny", "--dtype", "bfloat16"], "dtype=bfloat16"),
    ],
)
def test_bad_settings_are_refused_with_the_field_named(args: list[str], field: str, tmp_path: Path) -> None:
    proc = _init(*args, str(tmp_path / "ckpt"))
    assert proc.returncode == 2
    assert field in proc.stderr
    assert not (tmp_path / "ckpt" / "config.json").exists()


def test_init_tiny_is_still_the_tiny_writer(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dart.cli", "model", "init-tiny", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["text_config"]["hidden_size"] == 128
    assert config["text_config"]["vocab_size"] < 3000


def test_a_real_checkpoint_under_the_tiny_models_defaults_is_refused_or_warned(
    qwen3b_cut: Path, tmp_path: Path
) -> None:
    """The tiny model's defaults with a real-width checkpoint: what cannot work is refused naming the setting,
    the rest is warned about; the shipped real-checkpoint profile passes clean."""
    from dart.cli.stack.config import RunConfig, load_run_config
    from dart.cli.stack.real_checkpoint import check_real_checkpoint, image_tokens
    from dart.cli.stack.run import finalize
    from dart.protocol.errors import ConfigError

    def final(**settings: object) -> RunConfig:
        base = {"model": {"path": str(qwen3b_cut)}, "run": {"run_dir": str(tmp_path / "run")}}
        config = RunConfig.model_validate({**base, **settings})
        return finalize(config, qwen3b_cut, "nats://127.0.0.1:4222")

    tiny_defaults = check_real_checkpoint(final(), qwen3b_cut)
    assert any("image_size is 224" in w for w in tiny_defaults) and any("format is dart" in w for w in tiny_defaults)
    with pytest.raises(ConfigError, match=r"max_new_tokens.*is 16, below the \d+ tokens of a short complete answer"):
        check_real_checkpoint(final(rollout={"runner": {"max_new_tokens": 16}}), qwen3b_cut)
    # Two 1920x1080 screens at the processor's own rule are 2 x 2,691 tokens: more than a 4,096-token context.
    at_1080p = {
        "env": {"sim": {"width": 1920, "height": 1080}},
        "rollout": {
            "engine": {"kind": "vllm", "launch": {"max_model_len": 4096}},
            "runner": {"prompt": {"image_size": "model", "format": "ui-tars-1.5", "max_images": 2}},
        },
    }
    assert image_tokens(final(**at_1080p)) == 2691
    with pytest.raises(
        ConfigError, match=r"max_model_len.*is 4096, below what one prompt needs.*2 screenshot\(s\) of 2691"
    ):
        check_real_checkpoint(final(**at_1080p), qwen3b_cut)
    on_gpu = check_real_checkpoint(
        final(rollout={"engine": {"kind": "hf", "device": "cuda", "dtype": "float32"}}, train={"device": "cuda"}),
        qwen3b_cut,
    )
    assert any(w.startswith("rollout.engine.dtype is float32 on CUDA") for w in on_gpu)
    assert any(w.startswith("train.dtype is float32 on CUDA") for w in on_gpu)
    # The shipped profile, on this checkpoint: nothing to refuse, nothing to warn about.
    root = Path(__file__).resolve().parents[3]
    profile = load_run_config(root / "examples" / "real-checkpoint.yaml", [f"model.path={qwen3b_cut}"])
    profile = profile.model_copy(update={"run": profile.run.model_copy(update={"run_dir": tmp_path / "profile"})})
    assert check_real_checkpoint(finalize(profile, qwen3b_cut, "nats://127.0.0.1:4222"), qwen3b_cut) == []
    # The tiny model is never checked.
    assert check_real_checkpoint(RunConfig(), qwen3b_cut) == []
