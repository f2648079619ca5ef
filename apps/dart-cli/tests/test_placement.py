"""GPU placement of ``dart run``: every trainer, vLLM server and hf engine gets devices of its own, checked on a
machine without GPUs by declaring the count (``run.gpus``) and reading back each started process's environment
from ``/proc``; a run that needs more GPUs than the machine has is refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dart.cli.cluster.launch import spawn, stop_process
from dart.cli.stack.config import RunConfig, load_run_config
from dart.cli.stack.placement import placed, plan_placement
from dart.protocol.config import dump_config
from dart.protocol.errors import ConfigError
from dart.rollout.engine.vllm_config import VLLMEngineConfig
from dart.rollout.engine.vllm_server import server_args, server_env

TWO_RANKS_TWO_SERVERS: dict[str, Any] = {
    "run": {"gpus": 8},
    "train": {"device": "cuda", "backend": {"kind": "fsdp", "nproc": 2}},
    "rollout": {"num_engines": 2, "engine": {"kind": "vllm", "launch": {"tensor_parallel_size": 2}}},
}


def environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with (read once its new program is in place: until then the
    kernel shows none)."""
    deadline = time.monotonic() + 30.0
    while not (raw := Path(f"/proc/{pid}/environ").read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return dict(entry.split("=", 1) for entry in raw.decode().split("\0") if "=" in entry)


def test_the_plan_gives_every_process_gpus_of_its_own() -> None:
    config = RunConfig.model_validate(TWO_RANKS_TWO_SERVERS)
    placement = plan_placement(config, "run.yaml", count_gpus=lambda: 0, environ={})  # declared: torch is not asked

    assert [(p.service, p.process, p.devices) for p in placement.processes] == [
        ("train", "trainer", (0, 1)),
        ("rollout", "vllm-engine-0", (2, 3)),
        ("rollout", "vllm-engine-1", (4, 5)),
    ]
    assert placement.service_environment("train") == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert placement.service_environment("rollout") == {}  # the servers get theirs, one set each
    engine = placed(config, placement).rollout.engine
    assert isinstance(engine, VLLMEngineConfig) and engine.launch is not None
    assert engine.launch.devices == [[2, 3], [4, 5]]
    assert "--tensor-parallel-size" in server_args(engine, model_path="m", host="127.0.0.1", port=1)


def test_hf_engines_on_cuda_take_one_gpu_each_in_the_rollout_process() -> None:
    config = RunConfig.model_validate(
        {"run": {"gpus": 3}, "rollout": {"num_engines": 3, "engine": {"kind": "hf", "device": "cuda:1"}}}
    )
    placement = plan_placement(config, "run.yaml", environ={})

    assert placement.service_environment("rollout") == {"CUDA_VISIBLE_DEVICES": "0,1,2"}
    assert placement.service_environment("train") == {}  # a CPU trainer takes none
    assert placed(config, placement).rollout.engine.device == "cuda"  # type: ignore[union-attr]


def test_without_gpus_launched_vllm_servers_are_left_as_they_are() -> None:
    config = RunConfig.model_validate({"rollout": {"num_engines": 2, "engine": {"kind": "vllm"}}})
    placement = plan_placement(config, "run.yaml", count_gpus=lambda: 0, environ={})

    assert placement.processes == ()
    assert placed(config, placement) == config


def test_shared_gpus_put_the_trainer_and_the_engines_of_a_one_gpu_machine_on_it() -> None:
    one_gpu = {
        "run": {"gpus": 1, "share_gpus": True},
        "train": {"device": "cuda"},
        "rollout": {"num_engines": 2, "engine": {"kind": "hf", "device": "cuda"}},
    }
    placement = plan_placement(RunConfig.model_validate(one_gpu), "run.yaml", environ={})
    assert [(p.process, p.devices) for p in placement.processes] == [
        ("trainer", (0,)),
        ("hf-engine-0", (0,)),
        ("hf-engine-1", (0,)),
    ]
    assert placement.service_environment("rollout") == {"CUDA_VISIBLE_DEVICES": "0"}  # each GPU once
    # On three GPUs the 2-rank trainer takes 0 and 1, the 2-GPU server 2 and 0 (never one GPU twice), the next 1 and 2.
    three = {**TWO_RANKS_TWO_SERVERS, "run": {"gpus": 3, "share_gpus": True}}
    placement = plan_placement(RunConfig.model_validate(three), "run.yaml", environ={})
    assert [p.devices for p in placement.processes] == [(0, 1), (2, 0), (1, 2)]
    assert placement.vllm_devices() == [[2, 0], [1, 2]]
    # A process that alone needs more GPUs than the machine has is refused, shared or not.
    with pytest.raises(ConfigError, match="run.share_gpus cannot help"):
        plan_placement(RunConfig.model_validate({**three, "run": {"gpus": 1, "share_gpus": True}}), "r", environ={})
    with pytest.raises(ConfigError, match="or set run.share_gpus"):
        plan_placement(RunConfig.model_validate({**one_gpu, "run": {"gpus": 1}}), "run.yaml", environ={})


def test_gpus_dart_run_was_given_are_the_ones_it_hands_out() -> None:
    config = RunConfig.model_validate({**TWO_RANKS_TWO_SERVERS, "run": {}})
    given = {"CUDA_VISIBLE_DEVICES": "7,6,5,4,3,2"}
    placement = plan_placement(config, "run.yaml", count_gpus=lambda: 99, environ=given)

    assert placement.gpus == 6
    assert [p.devices for p in placement.processes] == [(7, 6), (5, 4), (3, 2)]
    declared = config.model_copy(update={"run": config.run.model_copy(update={"gpus": 8})})
    with pytest.raises(ConfigError, match="declares 8 GPUs but dart run was given 6"):
        plan_placement(declared, "run.yaml", environ=given)
    with pytest.raises(ConfigError, match="by index"):
        plan_placement(config, "run.yaml", environ={"CUDA_VISIBLE_DEVICES": "GPU-5f1c"})


def test_each_started_process_sees_the_gpus_the_plan_gave_it(tmp_path: Path) -> None:
    """The trainer's ``dart serve train`` process as ``dart run`` spawns it, and each vLLM server's environment as
    the rollout service builds it from the config file it reads."""
    config = RunConfig.model_validate(TWO_RANKS_TWO_SERVERS)
    config = config.model_copy(update={"bus": config.bus.model_copy(update={"url": "nats://127.0.0.1:1"})})
    placement = plan_placement(config, "run.yaml", environ={})
    config_file = tmp_path / "config.yaml"
    config_file.write_text(dump_config(placed(config, placement)))

    trainer = spawn("train", config_file, tmp_path, placement.service_environment("train"))
    try:
        assert environ(trainer.pid)["CUDA_VISIBLE_DEVICES"] == "0,1"
    finally:
        stop_process(trainer, 10.0)

    engine = load_run_config(config_file).rollout.engine  # what the rollout service reads
    assert isinstance(engine, VLLMEngineConfig) and engine.launch is not None
    for index, expected in enumerate(["2,3", "4,5"]):
        env = server_env(engine.launch, index, token="t")
        server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
        try:
            assert environ(server.pid)["CUDA_VISIBLE_DEVICES"] == expected
        finally:
            server.kill()
            server.wait()


def test_a_launch_config_cannot_count_gpus_two_ways() -> None:
    with pytest.raises(ValueError, match="use launch.tensor_parallel_size"):
        VLLMEngineConfig.model_validate({"launch": {"extra_args": ["--tensor-parallel-size", "2"]}})
    with pytest.raises(ValueError, match="tensor_parallel_size is 2"):
        VLLMEngineConfig.model_validate({"launch": {"tensor_parallel_size": 2, "devices": [[0]]}})
    with pytest.raises(ValueError, match="places 1 servers"):
        RunConfig.model_validate(
            {"rollout": {"num_engines": 2, "engine": {"kind": "vllm", "launch": {"devices": [[0]]}}}}
        )


def test_dart_run_refuses_a_run_that_needs_more_gpus_than_the_machine_has(tmp_path: Path) -> None:
    """Exit code 2, one line naming both counts, and no run directory."""
    runs = tmp_path / "runs"
    config = tmp_path / "run.yaml"
    settings = {**TWO_RANKS_TWO_SERVERS, "run": {"gpus": 1, "runs_root": str(runs)}}
    config.write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match="needs 6 GPUs"):
        plan_placement(load_run_config(config), str(config), environ={})

    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # every GPU of the machine
    cmd = [sys.executable, "-m", "dart.cli", "run", str(config)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)

    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "needs 6 GPUs (trainer 2, 2 vllm engines x 2) but the machine has 1 (run.gpus)" in lines[0]
    assert not runs.exists()
    assert time.monotonic() - started < 120
