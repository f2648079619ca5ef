"""megatron at TP=2 x DP=2 (4 gloo ranks) runs the shared RL update as one process does; bfloat16 keeps
float32 masters; a KL term is refused when the run starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pydantic
import pytest
import torch

from dart.protocol.messages import TrainingSample
from dart.train.backend import TorchBackend
from dart.train.batching import StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.errors import TrainerError

WORKER = Path(__file__).with_name("megatron_dp_worker.py")


@pytest.mark.unit
def test_a_kl_term_is_refused_at_start(tiny_checkpoint: Path) -> None:
    from dart.train.megatron import MegatronBackend

    with pytest.raises(pydantic.ValidationError, match=r"train\.loss\.kl_coef"):
        TrainerConfig.model_validate({"backend": "megatron", "loss": {"kl_coef": 0.1}})
    # Built from a config object that skipped validation: refused before any process group or model.
    config = SimpleNamespace(model_path=str(tiny_checkpoint), loss=SimpleNamespace(kl_coef=0.1))
    with pytest.raises(TrainerError, match=r"train\.loss\.kl_coef"):
        MegatronBackend.load(config)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_tp2_dp2_matches_one_process(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    # Three samples over two DP groups: one group also runs a zero-weight padding row.
    samples = [*rollout_samples, rollout_samples[0].model_copy(update={"trajectory_id": "t2"})]
    config: dict[str, object] = {"model_path": str(tiny_checkpoint), "lr": 1e-3, "micro_batch_size": 1}
    megatron = {"kind": "megatron", "tensor_parallel_size": 2, "data_parallel_size": 2}
    (tmp_path / "config.json").write_text(json.dumps({**config, "backend": megatron}))
    (tmp_path / "samples.json").write_text(json.dumps([s.model_dump(mode="json") for s in samples]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        str(WORKER), str(tmp_path / "config.json"), str(tmp_path / "samples.json"), str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=880, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    r = torch.load(tmp_path / "result.pt", weights_only=True)
    assert r["layout"] == [2, 2]

    single = TorchBackend.load(TrainerConfig.model_validate(config), image_source=StoreImageSource())
    reference = [single.train_step(samples).as_dict() for _ in range(2)]
    for got, want in zip(r["metrics"], reference, strict=True):
        assert got["samples"] == want["samples"] and got["tokens"] == want["tokens"]
        for key in ("loss", "ratio_mean", "tis_weight_mean", "rollout_mismatch", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    weights = single.full_state_dict()
    assert set(r["weights"]) == set(weights)
    assert max(float((r["weights"][k] - weights[k]).abs().max()) for k in weights) < 1e-4

    # bfloat16 at lr 1e-6: the float32 masters move as float32 training does (bf16 weights would not).
    fp32, bf16 = r["delta_float32"], r["delta_bfloat16"]
    ratio = float(bf16.norm() / fp32.norm())
    cosine = float(bf16 @ fp32 / (bf16.norm() * fp32.norm()))
    print(f"megatron bf16/fp32 update norm ratio {ratio:.4f}, cosine {cosine:.4f}")
    assert 0.9 < ratio < 1.1 and cosine > 0.9
    assert r["resume_params_bitwise"] and r["resume_published_bitwise"]
    assert r["published_dtypes"] == ["torch.bfloat16"]
