"""The weight-sync benchmark (benchmarks/weight_sync.py) runs end to end at the tiny shape: a version
published in shards to the local store and to a real S3 server, fetched, verified and loaded by the hf
engine, each phase timed, beside the raw copy / put + get of the same bytes and the one-fp32-file path; and
the LoRA path: an adapter version published, fetched and applied by the hf engine over the base, twice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("gather_s", "publish_s", "fetch_verify_s", "stage_s", "load_s")


def test_the_tiny_shape_runs_through_both_stores_and_the_fp32_baseline(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "weight_sync.py"), "--shapes", "tiny", "--engine", "hf"]
    cmd += ["--before", "--shard-mib", "0.5", "--lora", "4", "--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    adapters = [r for r in result["results"] if r.get("path", "").startswith("lora")]
    rows = {(r["store"], r["dtype"]): r for r in result["results"] if r not in adapters}
    assert set(rows) == {("local", "bfloat16"), ("s3", "bfloat16"), ("local", "float32")}
    assert [(r["store"], r["path"]) for r in adapters] == [
        (store, f"lora rank 4: {load}") for store in ("local", "s3") for load in ("first adapter", "next adapter")
    ]
    for row in adapters:  # one small file each, through every phase
        assert row["shards"] == 1 and row["bytes"] < rows[("local", "bfloat16")]["bytes"] / 10
        assert row["end_to_end_s"] == pytest.approx(sum(row[p] for p in PHASES), abs=0.01)
    for row in rows.values():
        assert row["end_to_end_s"] == pytest.approx(sum(row[p] for p in PHASES), abs=0.01)
        assert row["raw_s"] >= 0 and row["parameters"] > 700_000
        # What the store keeps of a version: its shards, plus the index and manifest.
        assert row["bytes"] <= row["store_growth_bytes"] < row["bytes"] + 64 * 1024
    bf16, fp32 = rows[("local", "bfloat16")], rows[("local", "float32")]
    assert bf16["shards"] >= 3 and fp32["shards"] == 1  # 0.5 MiB shards of a 1.4 MB bf16 model; one fp32 file
    assert fp32["bytes"] == pytest.approx(2 * bf16["bytes"], rel=0.01)
    assert rows[("s3", "bfloat16")]["raw_s"] == pytest.approx(
        rows[("s3", "bfloat16")]["raw_put_s"] + rows[("s3", "bfloat16")]["raw_get_s"], abs=0.002
    )
    assert result["largest_shape"] == "tiny" and result["largest_shape_ratio_to_raw"] is not None
    assert not any(tmp_path.iterdir())  # checkpoints, stores and copies are removed
