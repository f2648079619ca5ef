"""End to end with LoRA (`examples/smoke-lora.yaml`): the warm-started tiny policy stays frozen, the torch
trainer trains rank-8 adapters on its language model's attention, each version is published as the adapter
alone, and the hf engines hot-load it over the base model: their log-probs on a published adapter equal the
trainer's recomputation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dart.protocol.telemetry import read_jsonl
from dart.protocol.weights import WeightManifest, adapter_spec_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1300)]

ROOT = Path(__file__).resolve().parents[1]


def test_lora_adapters_train_publish_and_engines_serve_them(
    dart_run: Callable[..., tuple[dict[str, Any], Path]],
) -> None:
    summary, run_dir = dart_run(ROOT / "examples" / "smoke-lora.yaml", timeout_s=1150)
    assert summary["error"] is None
    assert summary["versions_published"] >= 2
    assert summary["trajectories_lost"] == 0
    assert summary["service_exit_codes"]["train"] == 0
    # Every version is an adapter: one small file that says so itself, and its manifest says it too.
    manifests = sorted(run_dir.rglob("weights/v*/manifest.json"))
    assert manifests, f"no published version under {run_dir}"
    for path in manifests:
        manifest = WeightManifest.model_validate_json(path.read_text())
        assert manifest.adapter is not None and manifest.adapter.rank == 8
        assert len(manifest.shards) == 1 and manifest.size_bytes < 200_000
        assert adapter_spec_of(path.parent / manifest.shards[0].name) == manifest.adapter
    steps = [
        r["attributes"]
        for r in read_jsonl(run_dir / "telemetry" / "train.jsonl", types={"event"})
        if r["name"] == "trainer.step"
    ]
    on_policy = [
        s for s in steps if s["min_policy_version"] >= 1 and s["max_policy_lag"] == 0 and not s["pool_samples"]
    ]
    lags = [(s["min_policy_version"], s["max_policy_lag"]) for s in steps]
    assert on_policy, f"no on-policy batch after an update among {lags}"
    # The engines applied the adapter the trainer published: their log-probs are the trainer's.
    assert min(s["rollout_mismatch"] for s in on_policy) < 1e-5
