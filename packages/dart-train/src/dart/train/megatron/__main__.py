"""Self-check and throughput probe of the megatron backend on N ranks: a few AdamW steps on synthetic rows.

Usage (one process per GPU, or ranks on CPU with gloo)::

    torchrun --nproc-per-node 2 -m dart.train.megatron --model /ckpt/tiny --tensor-parallel-size 2 --steps 3

Each DP group trains on its own synthetic row (one image and text, fixed by the seed and the DP
rank) to maximize its response's likelihood; rank 0 prints one JSON object as its last line:
layout, per-step losses, grad norms and wall times, and tokens/s over all ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from PIL import Image

from dart.train.batching import InputBuilder, ModelInputs
from dart.train.config import TrainerConfig
from dart.train.megatron.backend import MegatronBackend


def synthetic_row(backend: MegatronBackend, prompt_len: int, response_len: int, seed: int) -> ModelInputs:
    """A row of ``<vision_start> image <vision_end>`` and random text ids, a 224x224 random image."""
    cfg = backend.hf_config
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (224, 224, 3), generator=gen, dtype=torch.uint8).numpy()
    image = Image.fromarray(pixels, "RGB")
    image_tokens = 64  # 224 / 14 = 16 patches a side, merged 2 x 2
    # Ordinary text ids: Qwen's special tokens (from <|endoftext|>, the bos id) come after the BPE vocabulary.
    text_vocab = int(getattr(cfg.text_config, "bos_token_id", None) or cfg.vision_start_token_id)
    n_text = max(1, prompt_len - image_tokens - 2)
    text = torch.randint(0, text_vocab, (n_text + response_len,), generator=gen).tolist()
    prompt = [cfg.vision_start_token_id] + [cfg.image_token_id] * image_tokens + [cfg.vision_end_token_id]
    builder = InputBuilder(backend.processor, int(cfg.image_token_id))
    return builder.build(prompt + text[:n_text], text[n_text:], [image])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dart.train.megatron", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="local Hugging Face Qwen2.5-VL checkpoint directory")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    config = TrainerConfig(
        model_path=args.model,
        lr=args.lr,
        seed=args.seed,
        dtype=args.dtype,
        backend={
            "kind": "megatron",
            "tensor_parallel_size": args.tensor_parallel_size,
            "data_parallel_size": max(1, int(os.environ.get("WORLD_SIZE", "1")) // args.tensor_parallel_size),
        },
    )
    backend = MegatronBackend.create(config)
    row = synthetic_row(backend, args.prompt_len, args.response_len, args.seed + backend.data_parallel_rank)
    losses, norms, times = [], [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        logp, _ = backend.forward_logprobs(row)
        loss = -logp.mean()
        loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated here
        norms.append(backend.optimizer_step())
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        losses.append(float(loss.detach()))
    tokens = int(row.input_ids.shape[1]) * backend.data_parallel_size
    steady = times[1:] or times
    report = {
        "backend": "megatron",
        "world_size": backend.world_size,
        "tensor_parallel_size": backend.tensor_parallel_size,
        "data_parallel_size": backend.data_parallel_size,
        "device": str(backend.device.type),
        "dtype": args.dtype,
        "tokens_per_step": tokens,
        "losses": losses,
        "grad_norms": norms,
        "step_s": times,
        "tokens_per_s": tokens / (sum(steady) / len(steady)),
    }
    backend.close()
    if backend.is_main:
        print(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
