"""A launched vLLM server's process group is swept when the server dies while starting: its engine-core
processes (here a stand-in that leaves a child behind and exits, as a server SIGKILLed mid-start does)
must not outlive it holding their memory."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from dart.rollout.engine.vllm_config import VLLMEngineConfig, VLLMLaunchConfig
from dart.rollout.engine.vllm_server import VLLMServerProcess
from dart.rollout.errors import EngineStartError

pytestmark = pytest.mark.integration


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


async def test_a_server_that_dies_while_starting_leaves_no_process_of_its_group(tmp_path: Path) -> None:
    left = tmp_path / "engine-core.pid"
    launcher = tmp_path / "python"
    # The "server": starts a long-lived child in its own process group (an engine core), then dies.
    launcher.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {left}\nexit 1\n")
    launcher.chmod(0o755)
    launch = VLLMLaunchConfig(python=str(launcher), log_dir=str(tmp_path / "logs"), startup_timeout_s=60)
    server = VLLMServerProcess("engine-0", VLLMEngineConfig(model_path=str(tmp_path), launch=launch))
    with pytest.raises(EngineStartError, match="exited with code 1 while starting"):
        await server.start()
    child = int(left.read_text())
    for _ in range(300):  # init reaps it a moment after the kill
        if not alive(child):
            break
        await asyncio.sleep(0.1)
    assert not alive(child), "the server's child outlived it"
