"""The one-GPU check (benchmarks/gpu_check.py) runs on CPU at tiny size and reports every phase it ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _check(*args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == last
    return proc, last


def test_tiny_check_on_cpu_reports_every_phase(tmp_path: Path) -> None:
    proc, report = _check(
        "--tiny", "--phases", "checkpoint,train-torch,train-fsdp,train-screens,generate", "--steps", "2",
        "--samples", "2", "--prompt-len", "48", "--response-len", "16", "--gen-requests", "2", "--gen-concurrency",
        "2", "--max-new-tokens", "8", "--levers", "pack,ckpt,fused", "--screen-size", "320x180", tmp_path=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["ok"] is True and report["device"] == "cpu" and report["gpu_name"] is None
    assert "6 * N * S" in str(report["flop_formula"])
    phases = report["phases"]
    assert isinstance(phases, dict)
    assert list(phases) == ["checkpoint", "train-torch", "train-fsdp", "train-screens", "generate"]
    assert report["levers"] == ["pack", "ckpt", "fused"]
    assert phases["checkpoint"]["status"] == "ok" and phases["checkpoint"]["num_parameters"] > 0
    for name, world in (("train-torch", 1), ("train-fsdp", 1)):
        train = phases[name]
        assert train["status"] == "ok" and train["world_size"] == world and train["steps_timed"] == 2
        assert train["tokens_per_update"] == 2 * (48 + 16)
        assert train["tokens_per_s"] > 0 and train["tflops_per_s"] > 0 and train["flops_per_update"] > 0
        assert train["mfu"] is None  # no peak figure for a CPU
        assert train["levers"] == ["pack", "ckpt", "fused"] and train["images_per_sample"] == 0
    # Two screenshots per sample: their image tokens are in the row, the vision tower's FLOPs in the count.
    screens = phases["train-screens"]
    assert screens["status"] == "ok" and screens["images_per_sample"] == 2 and screens["steps_timed"] == 2
    assert screens["image_tokens_per_sample"] >= 2 * 4 and screens["tokens_per_update"] > 2 * (16 + 8)
    assert screens["tokens_per_s"] > 0 and screens["flops_per_update"] > 0
    generate = phases["generate"]
    assert generate["status"] == "ok" and 0 < generate["tokens"] <= 2 * 8 and generate["tokens_per_s"] > 0
    for phase in phases.values():
        # No GPU here: NVML's absence is recorded, never zeros.
        assert phase["gpu"]["samples"] == 0 and phase["gpu"]["unavailable"]
        assert phase["seconds"] > 0
    assert (tmp_path / "gpu_check.json.logs" / "train-fsdp.log").is_file()


def test_a_failing_phase_is_recorded_and_the_rest_still_run(tmp_path: Path) -> None:
    proc, report = _check(
        "--tiny", "--model", str(tmp_path / "no-checkpoint"), "--phases", "train-torch,generate",
        "--timeout", "generate=0.5", tmp_path=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    assert report["ok"] is False
    phases = report["phases"]
    assert isinstance(phases, dict)
    assert phases["train-torch"]["status"] == "failed" and phases["train-torch"]["exit_code"] != 0
    assert "no checkpoint at" in phases["train-torch"]["log_tail"]
    assert phases["generate"]["status"] == "timeout" and phases["generate"]["timeout_s"] == 0.5
