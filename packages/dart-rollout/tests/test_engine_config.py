"""``rollout.engine`` is kind-discriminated: hf (the default when ``kind`` is left out) or vllm."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from dart.rollout.engine.hf import HFEngineConfig
from dart.rollout.engine.vllm_config import VLLMEngineConfig, VLLMLaunchConfig
from dart.rollout.engine.vllm_server import TOKEN_ENV, auth_middleware_dir, chat_template_path, server_args, server_env
from dart.rollout.service.config import RolloutConfig

pytestmark = pytest.mark.unit


def test_engine_without_kind_is_hf() -> None:
    config = RolloutConfig.model_validate({"engine": {"model_path": "/ckpt", "device": "cpu"}})
    assert isinstance(config.engine, HFEngineConfig) and config.engine.kind == "hf"


def test_vllm_kind_alone_launches_with_defaults() -> None:
    config = RolloutConfig.model_validate({"engine": {"kind": "vllm"}, "num_engines": 2})
    assert isinstance(config.engine, VLLMEngineConfig)
    assert config.engine.launch is not None and config.engine.attach is None
    assert config.engine.pause_mode == "wait"


def test_vllm_attach_gives_one_engine_per_url() -> None:
    urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    config = RolloutConfig.model_validate({"engine": {"kind": "vllm", "attach": {"urls": urls}}, "num_engines": 2})
    assert isinstance(config.engine, VLLMEngineConfig) and config.engine.attach is not None
    with pytest.raises(ValidationError, match="num_engines is 3"):
        RolloutConfig.model_validate({"engine": {"kind": "vllm", "attach": {"urls": urls}}, "num_engines": 3})


def test_bad_engine_configs_are_refused() -> None:
    with pytest.raises(ValidationError, match="not both"):
        VLLMEngineConfig.model_validate({"launch": {}, "attach": {"urls": ["http://127.0.0.1:1"]}})
    with pytest.raises(ValidationError):
        RolloutConfig.model_validate({"engine": {"kind": "tgi"}})
    with pytest.raises(ValidationError):
        RolloutConfig.model_validate({"engine": {"kind": "vllm", "pause_mode": "abort"}})
    with pytest.raises(ValidationError):  # hf settings do not leak into vllm configs
        RolloutConfig.model_validate({"engine": {"kind": "vllm", "num_threads": 2}})


def test_server_args_carry_the_token_contract() -> None:
    args = server_args(VLLMEngineConfig(), model_path="/ckpt", host="127.0.0.1", port=8000)
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert args[args.index("--chat-template") + 1] == str(chat_template_path())
    assert chat_template_path().is_file()


def test_a_launched_servers_token_is_in_its_environment_and_its_check_on_its_path() -> None:
    args = server_args(VLLMEngineConfig(), model_path="/ckpt", host="127.0.0.1", port=8000)
    assert args[args.index("--middleware") + 1] == "dart_vllm_auth.BearerTokenMiddleware"
    env = server_env(VLLMLaunchConfig(env={TOKEN_ENV: "from-config"}), token="s3cret")
    assert env[TOKEN_ENV] == "s3cret" and "s3cret" not in " ".join(args)  # the launch's token wins
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(auth_middleware_dir())
    assert (auth_middleware_dir() / "dart_vllm_auth.py").is_file()


def test_launched_servers_never_prefill_a_prompt_in_chunks_by_default() -> None:
    # A seeded request prefilled in chunks kills the CPU build's engine (its generators have no offset).
    args = server_args(VLLMEngineConfig(), model_path="/ckpt", host="127.0.0.1", port=8000)
    assert args[args.index("--max-num-batched-tokens") + 1] == args[args.index("--max-model-len") + 1] == "4096"
    launch = VLLMLaunchConfig(max_model_len=8192, max_num_batched_tokens=16384)
    args = server_args(VLLMEngineConfig(launch=launch), model_path="/ckpt", host="127.0.0.1", port=8000)
    assert args[args.index("--max-num-batched-tokens") + 1] == "16384"


def test_each_launched_server_gets_its_gpus_and_their_settings() -> None:
    launch = VLLMLaunchConfig(tensor_parallel_size=2, gpu_memory_utilization=0.8, devices=[[0, 1], [2, 3]])
    args = server_args(VLLMEngineConfig(launch=launch), model_path="/ckpt", host="127.0.0.1", port=8000)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.8"
    assert [server_env(launch, i, token="t")["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["0,1", "2,3"]
    defaults = server_args(VLLMEngineConfig(), model_path="/ckpt", host="127.0.0.1", port=8000)
    assert "--tensor-parallel-size" not in defaults and "--gpu-memory-utilization" not in defaults
    with pytest.raises(ValidationError, match="use launch.devices"):
        VLLMLaunchConfig(env={"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(ValidationError, match="use launch.gpu_memory_utilization"):
        VLLMLaunchConfig(extra_args=["--gpu-memory-utilization=0.5"])
