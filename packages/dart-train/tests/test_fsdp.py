"""FSDP2 backend: 2 gloo ranks (real torchrun processes, activation checkpointing, fused AdamW and prefetched
all-gathers on) match one process (none of them); checkpoints resume exactly and a
published version is taken exactly (rank 0 reads it, every rank gets its shards); a
fault on one rank skips the batch on both; one rank out of memory in the update stops both, which run the
batch again at half the micro-batch size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dart.protocol.messages import TrainingSample
from dart.train.backend import TorchBackend
from dart.train.batching import StoreImageSource
from dart.train.config import TrainerConfig

pytestmark = pytest.mark.unit

WORKER = Path(__file__).with_name("fsdp_worker.py")
FAULT_WORKER = Path(__file__).with_name("rank_fault_worker.py")
OOM_WORKER = Path(__file__).with_name("oom_worker.py")


def _torchrun(worker: Path, config: dict[str, object], samples: list[TrainingSample], out: Path, nproc: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, "backend": {"kind": "fsdp", "nproc": nproc}}))
    (out / "samples.json").write_text(json.dumps([s.model_dump(mode="json") for s in samples]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(worker), str(out / "config.json"), str(out / "samples.json"), str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # The timeout only bounds a hang (ranks stuck in a collective): a passing run ends by itself.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _run_fsdp(config: dict[str, object], samples: list[TrainingSample], out: Path, nproc: int) -> dict[str, object]:
    _torchrun(WORKER, config, samples, out, nproc)
    result: dict[str, object] = torch.load(out / "result.pt", weights_only=True)
    return result


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8}], ids=["full", "lora"])
def test_fsdp_two_ranks_match_one_process_and_resume_exactly(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path, lora: dict[str, int] | None
) -> None:
    """Under LoRA the adapters alone have gradients, are published (named as peft saves them) and are
    checkpointed; the sharded base stays the checkpoint's."""
    config: dict[str, object] = {
        "model_path": str(tiny_checkpoint),
        "lr": 1e-3,
        "micro_batch_size": 1,
        "num_threads": 1,
        "lora": lora,
    }
    # The sharded run with the throughput levers on (the all-gathers prefetched by default): the same update.
    levers = {"activation_checkpointing": True, "optimizer_impl": "fused"}
    sharded = _run_fsdp({**config, **levers}, rollout_samples, tmp_path / "fsdp", nproc=2)

    single = TorchBackend.load(TrainerConfig.model_validate(config), image_source=StoreImageSource())
    grads: dict[str, torch.Tensor] = {}
    step = single.optimizer_step

    def capture() -> float:
        if not grads:
            grads.update({n: p.grad.clone() for n, p in single.model.named_parameters() if p.grad is not None})
        return step()

    single.optimizer_step = capture  # type: ignore[method-assign]
    reference = [single.train_step(rollout_samples).as_dict() for _ in range(3)]

    metrics = sharded["metrics"]
    assert isinstance(metrics, list)
    for ours, ref in zip(metrics, reference, strict=True):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    fsdp_grads = sharded["grads"]
    assert isinstance(fsdp_grads, dict) and fsdp_grads.keys() == grads.keys()
    for name, g in grads.items():
        scale = float(g.abs().max()) or 1.0
        assert float((fsdp_grads[name] - g).abs().max()) <= 1e-5 * scale, name
    final = sharded["final"]
    published, adapter = single.published_weights()
    assert isinstance(final, dict) and final.keys() == published.keys()
    assert (adapter is not None) == (lora is not None)
    if lora is not None:
        assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in final)
        assert all(".lora_" in n for n in grads)  # the base has no gradients
        # The checkpoint holds the adapters and their moments, not the base (which model_path holds).
        files = [f for f in (tmp_path / "fsdp" / "step-2").rglob("*") if f.is_file()]
        assert files and sum(f.stat().st_size for f in files) < 1_000_000
    for name, w in published.items():
        assert torch.allclose(final[name], w, rtol=1e-5, atol=1e-6), name
    # Resumed from the step-2 checkpoint, the third step lands on exactly the same weights.
    assert sharded["resumed_step"] == 3 - 1
    resumed = sharded["resumed_final"]
    assert isinstance(resumed, dict)
    for name, w in final.items():
        assert torch.equal(resumed[name], w), name
    # A trainer that trained elsewhere, then took the published version (rank 0 read it), holds exactly its
    # weights on every shard, with no optimizer moments left.
    taken = sharded["taken_final"]
    assert isinstance(taken, dict) and taken.keys() == final.keys()
    for name, w in final.items():
        assert torch.equal(taken[name], w), name
    assert sharded["taken_moments"] == 0


def test_faults_on_one_rank_skip_or_drop_on_both_and_training_goes_on(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    # rank_fault_worker.py: batch 0 cannot be read on rank 1, batch 1 has a sample unusable on rank 0 (its
    # owner), batch 2 the same in a batch formed for 2 samples, batch 3 no fault.
    config: dict[str, object] = {
        "model_path": str(tiny_checkpoint),
        "lr": 1e-3,
        "micro_batch_size": 1,
        "num_threads": 1,
    }
    _torchrun(FAULT_WORKER, config, rollout_samples, tmp_path, nproc=2)
    rank0 = json.loads((tmp_path / "rank-0.json").read_text())
    rank1 = json.loads((tmp_path / "rank-1.json").read_text())

    unavailable, dropped, too_few, trained = rank0["batches"]
    # Rank 0 built its share of batch 0 but skipped it too, with rank 1's reason: a transient store fault.
    assert unavailable["error"] == "BatchSkippedError"
    assert (unavailable["reason"], unavailable["rank"], unavailable["retryable"]) == ("image_unavailable", 1, True)
    assert "fault injected on rank 1" in unavailable["detail"]
    # Rank 0's unusable sample was dropped on both ranks, and the batch trained on the other one.
    assert dropped == {"step": 1, "samples": 1, "dropped": {"sample": 1}}
    # Formed for 2 samples, the batch with one left is refused on both, and redelivery would not help.
    assert too_few["error"] == "BatchSkippedError"
    assert (too_few["reason"], too_few["retryable"]) == ("too_few_samples", False)
    assert "fault injected on rank 0" in too_few["detail"]
    # The ranks stayed in step: the batches that trained did so once on both.
    assert trained == {"step": 2, "samples": 2, "dropped": {}}
    assert rank0["step"] == rank1["step"] == 2


def test_out_of_memory_on_one_rank_stops_both_and_the_batch_trains_at_half_the_micro_batch_size(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample], tmp_path: Path
) -> None:
    # oom_worker.py: rank 1 runs out of memory once in batch 2 (its third micro-step), and in every row of batch 3.
    config: dict[str, object] = {
        "model_path": str(tiny_checkpoint),
        "lr": 1e-3,
        "micro_batch_size": 2,
        "num_threads": 1,
    }
    # 4 samples, 2 per rank: one micro-step of 2 rows per batch.
    samples = rollout_samples + [s.model_copy(update={"trajectory_id": f"{s.trajectory_id}x"}) for s in rollout_samples]
    _torchrun(OOM_WORKER, config, samples, tmp_path, nproc=2)  # bounded: a rank left in a collective fails it
    rank0 = json.loads((tmp_path / "rank-0.json").read_text())
    rank1 = json.loads((tmp_path / "rank-1.json").read_text())
    first, second, retried, given_up, after = rank0["batches"]
    assert [b["micro_batch_size"] for b in (first, second, after)] == [2, 2, 2]
    assert first["retried"] == second["retried"] == after["retried"] == []
    # Rank 1's error stopped both ranks; the mini-batch ran again at size 1 and trained once.
    assert retried["micro_batch_size"] == 1 and retried["step"] == 3
    assert retried["retried"] == [{"rank": 1, "reason": "out_of_memory", "from_size": 2, "to_size": 1}]
    # Not even one sample per micro-batch fit: the batch is given up, on both ranks, naming the setting.
    assert given_up["error"] == "RankFailureError"
    assert (given_up["reason"], given_up["rank"], given_up["retryable"]) == ("out_of_memory", 1, False)
    assert "train.micro_batch_size 2 was halved down to 1" in given_up["message"]
    assert rank1["raised_in"] == {"2": 1, "3": 2}  # size 2, then size 1
    assert after["step"] == rank0["step"] == rank1["step"] == 4

    # Nothing of a failed attempt was applied: each batch's figures are those of one process at micro-batch
    # size 1 that never failed (the update does not depend on the micro-batch size).
    single = TorchBackend.load(
        TrainerConfig.model_validate({**config, "micro_batch_size": 1}), image_source=StoreImageSource()
    )
    for ours in (first, second, retried, after):
        ref = single.train_step(samples).as_dict()
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
