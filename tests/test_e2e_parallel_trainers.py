"""End to end with the trainers that span processes: FSDP2 on 2 ranks training a tiny Qwen3-VL
(`examples/smoke-qwen3.yaml`, which is `smoke-fsdp.yaml` with `model.family: qwen3-vl`) and megatron-core at
tensor-parallel size 2 on Qwen2.5-VL (`examples/smoke-megatron.yaml`). Each run trains, publishes full
Hugging Face checkpoints the engines load unchanged, and the engines' log-probs on the new weights match
the trainer's. Both runs train with the throughput levers on (packed micro-batches, activation checkpointing, the
fused AdamW step), so the match holds with them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dart.runtime.telemetry import read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1300)]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("smoke-qwen3.yaml", "smoke-megatron.yaml")


@pytest.mark.parametrize(
    "example",
    [pytest.param(e, marks=pytest.mark.warm_start(ROOT / "examples" / e)) for e in EXAMPLES],
)
def test_two_rank_trainer_trains_publishes_and_engines_match(
    example: str, dart_run: Callable[..., tuple[dict[str, Any], Path]]
) -> None:
    summary, run_dir = dart_run(ROOT / "examples" / example, timeout_s=1150)
    assert summary["error"] is None
    train = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    assert (train["packing"], train["activation_checkpointing"], train["optimizer_impl"]) == (True, True, "fused")
    assert summary["versions_published"] >= 2
    assert summary["trajectories_lost"] == 0
    assert summary["service_exit_codes"]["train"] == 0
    steps = [
        r["attributes"]
        for r in read_jsonl(run_dir / "telemetry" / "train.jsonl", types={"event"})
        if r["name"] == "trainer.step"
    ]
    assert steps, "the trainer took no step"
    # A batch generated entirely by published (updated) weights of the trainer's current version: the
    # engines loaded what rank 0 gathered, so their log-probs equal the trainer's recomputation.
    on_policy = [
        s for s in steps if s["min_policy_version"] >= 1 and s["max_policy_lag"] == 0 and not s["pool_samples"]
    ]
    assert on_policy, (
        f"no on-policy batch after an update among {[(s['min_policy_version'], s['max_policy_lag']) for s in steps]}"
    )
    assert min(s["rollout_mismatch"] for s in on_policy) < 1e-4
