"""The megatron-core backend: weight conversion, and a real 2-process (gloo, float32) run against transformers.

The multi-process part launches ``megatron_worker.py`` with torchrun once (building a TP=2 backend, then a
TP=1 x DP=2 one) and asserts on the differences it measured; see that file for what each figure is.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dart.train.errors import ParallelismError
from dart.train.megatron.convert import HF_HEAD, HF_LM, LMSpec, hf_to_megatron, is_language_model_key, megatron_to_hf

WORKER = Path(__file__).with_name("megatron_worker.py")
ROOT = Path(__file__).resolve().parents[3]


def _hf_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], LMSpec]:
    """The checkpoint's language-model tensors under transformers-5 state-dict names, and its spec."""
    from transformers import AutoConfig

    raw = load_file(str(checkpoint / "model.safetensors"))
    # The file uses the Qwen2-VL on-disk names; the in-memory model nests the text model one level deeper.
    state = {
        (HF_LM + k.removeprefix("model.") if k.startswith("model.") else k): v
        for k, v in raw.items()
        if not k.startswith("visual.")
    }
    return state, LMSpec.from_hf_config(AutoConfig.from_pretrained(checkpoint, local_files_only=True))


@pytest.mark.unit
@pytest.mark.parametrize("tp", [1, 2])
def test_conversion_round_trip_is_bitwise(tiny_checkpoint: Path, tp: int) -> None:
    state, spec = _hf_state(tiny_checkpoint)
    shards = [hf_to_megatron(state, spec, r, tp) for r in range(tp)]
    back = megatron_to_hf(shards, spec)
    assert set(back) == {k for k in state if is_language_model_key(k)}
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    # Each rank holds 1/tp of every sharded tensor; norms are whole on every rank.
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape[0] == (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim // tp
    assert torch.equal(shards[-1]["decoder.final_layernorm.weight"], state[HF_LM + "norm.weight"])


@pytest.mark.unit
def test_qkv_is_grouped_per_kv_head_and_fc1_stacks_gate_up_per_rank() -> None:
    spec = LMSpec(
        num_layers=1, hidden_size=4, num_heads=4, num_kv_heads=2, head_dim=1, ffn_size=4, vocab_size=5, tied=False
    )
    state = _numbered_state(spec)
    rank1 = hf_to_megatron(state, spec, tp_rank=1, tp_size=2)
    q, k, v = (state[f"{HF_LM}layers.0.self_attn.{p}_proj.bias"] for p in "qkv")
    # Group 1 (the second kv head) owns query heads 2 and 3: rows [q2, q3, k1, v1].
    assert rank1["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == [q[2], q[3], k[1], v[1]]
    gate, up = state[f"{HF_LM}layers.0.mlp.gate_proj.weight"], state[f"{HF_LM}layers.0.mlp.up_proj.weight"]
    assert torch.equal(rank1["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[2:], up[2:]]))


def _numbered_state(spec: LMSpec) -> dict[str, torch.Tensor]:
    """A language-model state dict whose every entry is distinct, so a misplaced row cannot go unseen."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_size
    shapes = {
        HF_LM + "embed_tokens.weight": (spec.vocab_size, h),
        HF_LM + "norm.weight": (h,),
        HF_HEAD: (spec.vocab_size, h),
    }
    for i in range(spec.num_layers):
        p = f"{HF_LM}layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (spec.num_heads * d, h),
            p + "self_attn.q_proj.bias": (spec.num_heads * d,),
            p + "self_attn.k_proj.weight": (spec.num_kv_heads * d, h),
            p + "self_attn.k_proj.bias": (spec.num_kv_heads * d,),
            p + "self_attn.v_proj.weight": (spec.num_kv_heads * d, h),
            p + "self_attn.v_proj.bias": (spec.num_kv_heads * d,),
            p + "self_attn.o_proj.weight": (h, spec.num_heads * d),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    out, start = {}, 0.0
    for name, shape in shapes.items():
        n = int(torch.tensor(shape).prod())
        out[name] = torch.arange(start, start + n).reshape(shape)
        start += n
    return out


@pytest.mark.unit
def test_vocabulary_is_padded_to_a_multiple_of_tp_and_unpadded_exactly() -> None:
    spec = LMSpec(
        num_layers=2, hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=2, ffn_size=6, vocab_size=7, tied=False
    )
    state = _numbered_state(spec)
    shards = [hf_to_megatron(state, spec, r, 2) for r in range(2)]
    assert [s["output_layer.weight"].shape[0] for s in shards] == [4, 4]
    assert torch.equal(shards[1]["embedding.word_embeddings.weight"][-1], torch.zeros(8))  # the padding row
    back = megatron_to_hf(shards, spec)
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.unit
def test_tied_embeddings_have_no_output_layer() -> None:
    spec = LMSpec(
        num_layers=1, hidden_size=4, num_heads=2, num_kv_heads=2, head_dim=2, ffn_size=4, vocab_size=6, tied=True
    )
    state = _numbered_state(spec)
    state[HF_HEAD] = state[HF_LM + "embed_tokens.weight"]
    shard = hf_to_megatron(state, spec, 0, 1)
    assert "output_layer.weight" not in shard
    assert torch.equal(megatron_to_hf([shard], spec)[HF_HEAD], state[HF_HEAD])


@pytest.mark.unit
@pytest.mark.parametrize("tp", [0, 3, 4])
def test_tensor_parallel_sizes_that_do_not_split_the_model_are_refused(tp: int) -> None:
    spec = LMSpec(
        num_layers=1, hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=2, ffn_size=6, vocab_size=7, tied=False
    )
    with pytest.raises(ParallelismError):
        hf_to_megatron(_numbered_state(spec), spec, 0, tp)


@pytest.mark.unit
def test_a_config_asking_for_pipeline_stages_is_refused_at_load() -> None:
    """Refused when the config is read, naming the field, not only when the ranks start."""
    from pydantic import ValidationError

    from dart.train.config import TrainerConfig

    with pytest.raises(ValidationError, match="pipeline_parallel_size 2: pipeline parallelism is not supported"):
        TrainerConfig(backend={"kind": "megatron", "tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    TrainerConfig(backend={"kind": "megatron", "tensor_parallel_size": 2, "data_parallel_size": 2})


@pytest.mark.unit
def test_only_dart_train_imports_megatron() -> None:
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    pattern = re.compile(r"^\s*(import|from) megatron\b", re.MULTILINE)
    offenders = [
        name
        for name in files.split()
        if not name.startswith("packages/dart-train/") and pattern.search((ROOT / name).read_text(errors="replace"))
    ]
    assert offenders == []
    # The pattern does find the imports where they are.
    assert pattern.search((ROOT / "packages/dart-train/src/dart/train/megatron/model.py").read_text())


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_tensor_parallel_backend_matches_transformers(tiny_checkpoint: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*cmd, str(WORKER), str(tiny_checkpoint), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["layout"] == [2, 1] and r["layout_tp1"] == [1, 2] and r["dp_rank_size"] == [0, 2]
    # HF -> Megatron TP=2 (live GPTModel parameters) -> HF: same names, bitwise equal.
    assert r["roundtrip_same_keys"] and r["roundtrip_bitwise"]
    # Forward: logits, tempered log-probs and entropies as transformers computes them.
    assert r["logits_max_abs"] < 1e-5 and r["logits_scale"] > 0.1
    assert r["logprob_entropy_max_abs"] < 1e-5
    # The output layer ran on the response-predicting positions only, not on the prompt's.
    assert r["head_rows"] == [response for response, _ in r["response_and_sequence_lens"]]
    assert all(response < seq for response, seq in r["response_and_sequence_lens"])
    # Backward: every parameter's gradient (vision tower included) in HF layout, relative to its norm.
    assert r["grads_same_keys"] and r["grads_max_rel"] < 1e-5
    # Packed into one forward pass: the same log-probs, entropies and gradients, the output layer run once.
    assert r["packed_logprob_entropy_max_abs"] < 1e-5 and r["packed_grads_max_rel"] < 1e-5
    assert r["packed_head_rows"] == [sum(response for response, _ in r["response_and_sequence_lens"])]
    # Checkpointed: both decoder layers ran again in the backward pass of each row, the gradients unchanged.
    assert r["checkpointed_silu_in_backward"] >= 2 * len(r["response_and_sequence_lens"])
    assert r["checkpointed_grads_max_rel"] < 1e-5
    # Training: the loss decreases, TP-aware norms equal the single-process ones, weights follow transformers.
    losses = r["tp2_losses"]
    assert r["step"] == 3 and losses[0] > losses[1] > losses[2]
    # The first norm sees identical weights; later ones weights that Adam moved by ~lr * sign(grad), where
    # float32 noise on near-zero gradient entries decides the sign: agreement loosens to ~1e-4 relative.
    norms, ref_norms = r["tp2_norms"], r["ref_norms"]
    assert abs(norms[0] - ref_norms[0]) <= 1e-5 * ref_norms[0]
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(norms, ref_norms, strict=True))
    assert r["ref_norms"][0] > 1.0  # so clipping (to 1.0) acted, and the clipped updates agree
    assert r["weights_moved_max_abs"] > 1e-3 and r["tp2_vs_hf_weights_max_abs"] < 1e-4
    # TP=1 x DP=2 follows the same trajectory as TP=2.
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["tp1_losses"], losses, strict=True))
    assert r["tp1_vs_tp2_weights_max_abs"] < 1e-4
    # Checkpoints: resuming after step 1 repeats steps 2-3 bitwise; another TP size is refused.
    assert r["step_after_load"] == 1 and r["resume_losses_equal"] and r["resume_bitwise"]
    assert r["tp_mismatch_refused"]
    # A published version taken after training: every TP shard holds its weights again, with no moments left.
    assert r["published_taken_bitwise"] and r["published_taken_moments"] == 0
    # A vocabulary of 923 at TP=2 is padded to 924 inside megatron; outside, it is 923 columns, as transformers'.
    seq = r["odd_vocab_shapes"][1][0]
    assert r["odd_vocab_shapes"] == [[seq, 923], [seq, 923]]
    assert r["odd_vocab_logits_max_abs"] < 1e-5 and r["odd_vocab_logprob_entropy_max_abs"] < 1e-5
    assert r["odd_vocab_roundtrip_bitwise"]
