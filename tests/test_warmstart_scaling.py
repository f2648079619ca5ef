"""The warm-start scaling study (benchmarks/warmstart_scaling.py) runs end to end at toy size."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import warmstart_scaling


def test_a_configuration_trains_and_is_evaluated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.jsonl"
    code = warmstart_scaling.main(["--configs", "tiny:1:3:4:0.01", "--evals", "2", "--threads", "1", "--out", str(out)])
    assert code == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (result,) = last["results"]
    assert result["config"]["name"] == "tiny:1:3:4:0.01"
    assert result["demos"] >= 4  # one oracle episode of each family
    assert result["steps_done"] == 3
    assert [p["step"] for p in result["curve"]] == [2, 3]
    for point in result["curve"]:
        assert 0.0 <= point["heldout"] <= 1.0 and 0.0 <= point["train"] <= 1.0
        assert point["loss"] > 0 and point["heldout_nll"] > 0
    assert json.loads(out.read_text()) == result


@pytest.mark.parametrize("text", ["huge:16:10:4", "tiny:16:10", "tiny:x:10:4"])
def test_a_malformed_configuration_is_refused(text: str) -> None:
    with pytest.raises((argparse.ArgumentTypeError, ValueError)):
        warmstart_scaling.Config.parse(text)
