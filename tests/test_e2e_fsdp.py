"""End to end with the FSDP2 trainer on 2 ranks: `dart run examples/smoke-fsdp.yaml` trains, publishes full
checkpoints the engines load unchanged, and the engines' log-probs on the new weights match the trainer's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dart.protocol.telemetry import read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1300)]

ROOT = Path(__file__).resolve().parents[1]


def test_fsdp_two_ranks_train_publish_and_engines_match(dart_run: Callable[..., tuple[dict[str, Any], Path]]) -> None:
    summary, run_dir = dart_run(ROOT / "examples" / "smoke-fsdp.yaml", timeout_s=1150)
    assert summary["error"] is None
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
