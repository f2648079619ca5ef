"""The phases of ``gpu_check.py``, each run in its own process: ``python gpu_check.py --worker PHASE ...``.

Every worker writes its figures as one JSON object to ``--worker-out`` (rank 0 only under torchrun).
Kept apart from the orchestration so a phase can be run (and debugged) alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from trainer_throughput import LEVERS, image_samples, synthetic_samples

from dart.protocol.messages import Sampling

# Peak dense bf16 tensor throughput by GPU name (vendor data sheets), FLOP/s. The first match wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM / HBM3
    ("H200", 989e12),
    ("A100", 312e12),
)

VISION_FLOP_FORMULA = (
    "plus, with screenshots, 8 * (N_blocks + N_merger / m^2) per image patch: the vision tower's training and no-grad "
    "passes, N_blocks its blocks' parameters, N_merger the patch merger's (run once per m x m patches), attention "
    "within windows not counted"
)

FLOP_FORMULA = (
    "per update: sum over samples of S * (8 * N + 16 * L * d * S): the training pass 6 * N * S + 12 * L * d * S^2 "
    "(PaLM appendix B, attention counted non-causal) plus the no-grad logp_old pass 2 * N * S + 4 * L * d * S^2; "
    "S = a sample's tokens (prompt + response, one unpadded row), N = language-model parameters a text token "
    "passes through (decoder layers, final norm, lm_head; no input embedding), L = decoder layers, d = attention "
    "width (heads x head_dim); image tokens count as tokens of S"
)


def peak_flops(gpu_name: str | None) -> float | None:
    """The peak bf16 FLOP/s of ``gpu_name``; None when unknown (or no GPU)."""
    for key, peak in PEAK_BF16_FLOPS:
        if gpu_name and key in gpu_name:
            return peak
    return None


def gpu_name(device: str) -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else None


def write_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    """Write the check's policy: the tiny one, or ``--arch`` (cut by --layers / --vision-blocks) in bf16."""
    from dataclasses import asdict

    started = time.perf_counter()
    if args.tiny:
        from dart.policy.tiny import write_tiny_checkpoint

        manifest: Any = write_tiny_checkpoint(args.model, seed=0)
    else:
        import torch

        from dart.policy.architectures import get_architecture
        from dart.policy.random_init import write_checkpoint as write_arch

        arch = get_architecture(args.arch).cut(layers=args.layers, vision_blocks=args.vision_blocks)
        # On a GPU the random init runs there (seconds instead of a minute on the host's cores).
        device = torch.device("cuda" if args.device.startswith("cuda") else "cpu")
        with device:
            manifest = write_arch(args.model, arch, dtype="bfloat16", seed=0)
    figures = asdict(manifest)
    figures.pop("spec", None)
    return {**figures, "write_s": round(time.perf_counter() - started, 1)}


def update_flops(model: Any, lengths: list[int]) -> float:
    """FLOPs of one RL update on rows of ``lengths`` tokens (see :data:`FLOP_FORMULA`)."""
    lm = model.model.language_model
    n = sum(p.numel() for p in lm.parameters()) - lm.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    text = model.config.text_config
    layers, width = text.num_hidden_layers, text.num_attention_heads * (text.hidden_size // text.num_attention_heads)
    return float(sum(s * (8 * n + 16 * layers * width * s) for s in lengths))


def vision_flops(model: Any, grids: list[tuple[int, int, int]]) -> float:
    """FLOPs of the vision tower in one RL update on images of patch ``grids`` (see :data:`VISION_FLOP_FORMULA`)."""
    visual = model.model.visual
    blocks = sum(p.numel() for p in visual.blocks.parameters())
    merger = sum(p.numel() for p in visual.merger.parameters())
    merge = int(model.config.vision_config.spatial_merge_size) ** 2
    return float(sum(8 * t * h * w * (blocks + merger / merge) for t, h, w in grids))


def train(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """Time RL updates of one trainer backend on synthetic samples (text only, or ``kind`` ``screens``: the torch
    backend on samples with ``--screens`` screenshots each); tokens/s and MFU."""
    import torch

    from dart.train.config import TrainerConfig
    from dart.train.interface import load_backend
    from dart.train.update import RLUpdate, SampleReader

    screens = kind == "screens"
    kind = "torch" if screens else kind
    backend_cfg: dict[str, Any] = {"kind": kind}
    if kind == "megatron":
        backend_cfg["tensor_parallel_size"] = 1
    # bf16 on a GPU: torch and megatron keep a bfloat16 model over float32 master weights; FSDP keeps
    # float32 sharded parameters (its masters) and computes in bfloat16 through its mixed precision.
    dtype = "float32" if args.device == "cpu" or kind == "fsdp" else "bfloat16"
    if kind == "fsdp" and args.device != "cpu":
        backend_cfg["mixed_precision"] = "bf16"
    config = TrainerConfig.model_validate(
        {
            "model_path": args.model,
            "backend": backend_cfg,
            "device": args.device,
            "dtype": dtype,
            "lr": 1e-6,
            "micro_batch_size": args.micro_batch_size,
            **{key: value for lever in args.levers for key, value in LEVERS[lever].items()},
        }
    )
    started = time.perf_counter()
    backend = load_backend(config)
    load_s = time.perf_counter() - started
    model_cfg = json.loads((Path(args.model) / "config.json").read_text())
    bos = int(model_cfg["text_config"]["bos_token_id"])  # the special tokens start here: stay below them
    if screens:
        width, _, height = args.screen_size.partition("x")
        size, store = (int(width), int(height)), Path(args.worker_out).with_suffix(".store")
        samples = image_samples(args.samples, size, args.response_len, args.model, store, seed=0, images=args.screens)
    else:
        samples = synthetic_samples(args.samples, args.prompt_len, args.response_len, bos, seed=0)
    reader = SampleReader(config)
    inputs = [reader(s) for s in samples]
    cuda = args.device.startswith("cuda")
    times = []
    for i in range(args.steps + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        RLUpdate(backend, config).run(samples, inputs)
        if cuda:
            torch.cuda.synchronize()
        if i > 0:  # the first update warms up (allocations, kernels)
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    lengths = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples]
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):  # only the shapes, for the FLOP count
        shapes = Qwen2_5_VLForConditionalGeneration._from_config(AutoConfig.from_pretrained(args.model))
    flops = update_flops(shapes, lengths)
    grids = [tuple(int(v) for v in g) for x in inputs if x.image_grid_thw is not None for g in x.image_grid_thw]
    flops += vision_flops(shapes, grids)  # type: ignore[arg-type]
    peak = peak_flops(gpu_name(args.device))
    return {
        "backend": kind,
        "levers": list(args.levers),
        "images_per_sample": args.screens if screens else 0,
        "image_tokens_per_sample": round(sum(int(x.mm_token_type_ids.sum()) for x in inputs) / len(inputs), 1),
        "world_size": int(getattr(backend, "world_size", 1)),
        "dtype": dtype,
        "mixed_precision": backend_cfg.get("mixed_precision", "none"),
        "load_s": round(load_s, 1),
        "step_s": round(step_s, 4),
        "steps_timed": len(times),
        "tokens_per_update": sum(lengths),
        "tokens_per_s": round(sum(lengths) / step_s, 1),
        "flops_per_update": flops,
        "tflops_per_s": float(f"{flops / step_s / 1e12:.4g}"),
        "mfu": round(flops / step_s / peak, 4) if peak else None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }


async def _generate(args: argparse.Namespace) -> dict[str, Any]:
    from PIL import Image

    from dart.policy.prompt import build_prompt
    from dart.rollout.engine.hf import HFEngine, HFEngineConfig
    from dart.rollout.engine.interface import GenerationRequest

    dtype = "float32" if args.device == "cpu" else "bfloat16"
    started = time.perf_counter()
    engine = await HFEngine.start(
        HFEngineConfig(model_path=args.model, device=args.device, dtype=dtype, max_batch_size=args.gen_concurrency)
    )
    load_s = time.perf_counter() - started
    # A 1280x720 screenshot at the processor's own resolution rules (the tiny processor makes it 224 px).
    prompts = [
        build_prompt(
            f"Open the settings page {i}.", Image.new("RGB", (1280, 720), (i * 37 % 256, 90, 120)), image_size=None
        )
        for i in range(args.gen_requests)
    ]
    gate = asyncio.Semaphore(args.gen_concurrency)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with gate:
            request = GenerationRequest(
                prompts[i], max_new_tokens=args.max_new_tokens, sampling=Sampling(temperature=1.0), seed=i
            )
            tokens += len((await engine.generate(request)).response_token_ids)

    try:
        await asyncio.gather(*(one(i) for i in range(min(2, args.gen_requests))))  # warm-up
        tokens = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.gen_requests)))
        wall = time.perf_counter() - t0
    finally:
        await engine.close()
    return {
        "dtype": dtype,
        "load_s": round(load_s, 1),
        "requests": args.gen_requests,
        "concurrency": args.gen_concurrency,
        "max_new_tokens": args.max_new_tokens,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
    }


def generate(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s of the hf engine with ``--gen-concurrency`` requests in flight."""
    return asyncio.run(_generate(args))


def run_worker(args: argparse.Namespace) -> None:
    """Run ``args.worker`` in this process and write its figures to ``args.worker_out``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker == "checkpoint":
        result = write_checkpoint(args)
    elif args.worker == "generate":
        result = generate(args)
    else:
        result = train(args, args.worker.removeprefix("train-"))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.worker_out).write_text(json.dumps(result))
