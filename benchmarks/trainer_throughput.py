"""Trainer throughput per backend and world size: step time and tokens/s of the shared RL update on one batch.

Every configuration trains on the same synthetic batch (text-only samples of fixed prompt and response
length, seeded) from the same checkpoint: ``torch`` in this process, ``torch+lora`` the same with LoRA
adapters of rank ``--lora-rank`` on the language model's attention (``train.lora``), ``fsdp`` with 1 and 2 ranks under
torchrun (this script re-runs itself as the worker), ``megatron`` when ``dart.train.megatron`` imports. Suffixes
switch the throughput levers on, one or several: ``+pack`` (``train.packing``), ``+ckpt``
(``train.activation_checkpointing``), ``+fused`` / ``+foreach`` / ``+forloop`` (``train.optimizer_impl``), e.g.
``torch+pack+ckpt`` or ``fsdp+fused:2``; ``optimizer_step_s`` is the median time of one optimizer step.
Memory per configuration: ``trainable_parameters`` and ``optimizer_state_mib`` (AdamW's moments, plus the
float32 masters under bfloat16), read from the tensors after the updates; ``peak_rss_mib``, the peak resident
memory of the (rank 0) process, each configuration running in a process of its own; ``peak_gpu_mib`` on CUDA.
With ``--image WxH`` every sample's prompt carries one screenshot of that size (random pixels, stored as PNG in a
local store, the prompt encoded by the rollout's own prompt builder), read back through the trainer's
:class:`~dart.train.update.SampleReader`. Each rank builds its inputs as the trainer does (``--inputs share``:
:func:`~dart.train.shares.build_share`, only the samples it owns) or as every rank once did (``--inputs all``:
every sample's), and reports ``ranks``: per rank, ``input_mib`` (the tensors of the inputs it built) and
``peak_rss_mib``. The default tiny checkpoint then gets Qwen2.5-VL's pixel bounds (the inputs of a screenshot
are the real model's: they depend on the processor alone). The first update of each run warms up and is not
timed. Tokens/s counts prompt + response tokens of the samples each update trains on, divided by the update's
wall time (all optimizer steps included).

Usage::

    uv run python benchmarks/trainer_throughput.py                       # tiny random checkpoint, CPU
    uv run python benchmarks/trainer_throughput.py --model /ckpt/qwen2.5-vl-3b --device cuda \\
        --configs torch fsdp:1 fsdp:2 --dtype bfloat16 --samples 16 --prompt-len 1024 --response-len 128

The last line is one JSON object: ``{"results": [{"backend", "world_size", "step_s", "tokens_per_s",
"trainable_parameters", "optimizer_state_mib", "peak_rss_mib", "ranks", ...}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LEVERS: dict[str, dict[str, Any]] = {
    "lora": {},  # the adapters: set from --lora-rank
    "pack": {"packing": True},
    "ckpt": {"activation_checkpointing": True},
    "fused": {"optimizer_impl": "fused"},
    "foreach": {"optimizer_impl": "foreach"},
    "forloop": {"optimizer_impl": "for_loop"},
}
"""What a configuration's ``+lever`` suffixes switch on (``torch+pack+ckpt``, ``fsdp+fused:2``)."""


def _sample(i: int, prompt_ids: list[int], response_ids: list[int], images: list[Any] | None = None) -> Any:
    """Sample ``i`` of a benchmark batch: one step, advantages alternating +1/-1, behaviour log-probs -1."""
    from dart.protocol.messages import TrainingSample

    return TrainingSample(
        trajectory_id=f"t{i}",
        step_index=0,
        group_id="g",
        task_id="bench",
        advantage=1.0 if i % 2 == 0 else -1.0,
        reward=float(i % 2 == 0),
        policy_version=0,
        prompt_token_ids=prompt_ids,
        response_token_ids=response_ids,
        rollout_logprobs=[-1.0] * len(response_ids),
        images=images or [],
    )


def synthetic_samples(n: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> list[Any]:
    """``n`` text-only samples of random tokens below ``vocab`` (advantages alternating +1/-1), the same for a seed."""
    import random

    rng = random.Random(seed)
    return [
        _sample(
            i,
            [rng.randrange(100, vocab) for _ in range(prompt_len)],
            [rng.randrange(100, vocab) for _ in range(response_len)],
        )
        for i in range(n)
    ]


def image_samples(
    n: int, size: tuple[int, int], response_len: int, model: str, root: Path, seed: int, images: int = 1
) -> list[Any]:
    """``n`` one-step samples whose prompt carries ``images`` screenshots of ``size`` (random pixels; the current
    screen and ``images - 1`` of history), stored as PNG under ``root`` (a local store); the prompt is encoded by the
    rollout's prompt builder at the processor's own sizing, the response random tokens."""
    import random

    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    from dart.policy.prompt import HistoryStep, build_prompt, encode_prompt
    from dart.runtime.store import LocalStore
    from dart.train.testing import store_png

    rng, pixels = random.Random(seed), np.random.default_rng(seed)
    store = LocalStore(root, fsync=False)
    processor = AutoProcessor.from_pretrained(model, local_files_only=True)
    vocab = _text_vocab(model)

    def screen() -> Any:
        return Image.fromarray(pixels.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))

    samples = []
    for i in range(n):
        history = [HistoryStep("Action: click(start_box='(10,20)')", screen()) for _ in range(images - 1)]
        prompt = build_prompt("Click the button.", screen(), history, max_images=images, image_size=None)
        response = [rng.randrange(100, vocab) for _ in range(response_len)]
        shots = [store_png(store, f"shots/{i}/{j}.png", image) for j, image in enumerate(prompt.images)]
        samples.append(_sample(i, encode_prompt(processor, prompt).input_ids, response, shots))
    return samples


def _real_pixel_bounds(model: Path) -> None:
    """Give the tiny checkpoint's processor Qwen2.5-VL's own pixel bounds (it sizes every image to 224 x 224), so
    a screenshot's inputs are as large as the real model's: the pixel patches depend on the processor alone."""
    path = model / "processor_config.json"
    config = json.loads(path.read_text())
    config["image_processor"]["size"] = {"shortest_edge": 3136, "longest_edge": 12845056}
    path.write_text(json.dumps(config, indent=2))


def _text_vocab(model: str) -> int:
    """Token ids below this are ordinary text (the special tokens, image pads among them, lie above)."""
    config = json.loads((Path(model) / "config.json").read_text())
    vocab = int(config.get("text_config", {}).get("vocab_size", config.get("vocab_size", 1000)))
    return min(vocab - 300, 150000)


def _input_bytes(inputs: Any) -> int:
    tensors = (inputs.input_ids, inputs.mm_token_type_ids, inputs.pixel_values, inputs.image_grid_thw)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _measure(args: argparse.Namespace, kind: str, nproc: int) -> dict[str, Any]:
    """Run the updates in this process (one of the ranks under torchrun); returns the figures."""
    import resource

    import torch

    from dart.protocol.messages import TrainingSample
    from dart.train import collectives
    from dart.train.batching import StoreImageSource
    from dart.train.config import TrainerConfig
    from dart.train.interface import load_backend
    from dart.train.shares import build_share
    from dart.train.update import RLUpdate, SampleReader

    kind, *levers = kind.split("+")
    unknown = set(levers) - set(LEVERS)
    if unknown:
        raise SystemExit(f"unknown lever(s) {sorted(unknown)}: choose from {sorted(LEVERS)}")
    lora = "lora" in levers
    backend_cfg: dict[str, Any] = {"kind": kind}
    if kind == "fsdp":
        backend_cfg["nproc"] = nproc
    elif kind == "megatron":
        backend_cfg["tensor_parallel_size"] = nproc
    config = TrainerConfig.model_validate(
        {
            "model_path": args.model,
            "backend": backend_cfg,
            "device": args.device,
            "dtype": args.dtype,
            "lr": 1e-5,
            "micro_batch_size": args.micro_batch_size,
            "num_threads": args.threads,
            "lora": {"rank": args.lora_rank, "alpha": 2 * args.lora_rank} if lora else None,
            **{key: value for lever in levers for key, value in LEVERS[lever].items()},
        }
    )
    backend = load_backend(config)
    if args.samples_file:  # image samples, made once by the parent for every rank
        rows = json.loads(Path(args.samples_file).read_text())
        samples = [TrainingSample.model_validate(row) for row in rows]
    else:  # text only: image pads would need images
        samples = synthetic_samples(args.samples, args.prompt_len, args.response_len, _text_vocab(args.model), 0)
    reader = SampleReader(config, StoreImageSource())
    owners = None
    if args.inputs == "all":
        inputs: dict[int, Any] = dict(enumerate(reader(s) for s in samples))
    else:
        share = build_share(
            reader,
            samples,
            rank=backend.rank,
            world_size=backend.world_size,
            dp_rank=backend.dp_rank,
            dp_size=backend.dp_size,
            mini_batches=config.mini_batches,
        )
        samples, owners, inputs = share.samples, share.owners, share.inputs
    input_mib = round(sum(_input_bytes(x) for x in inputs.values()) / 2**20, 1)
    times, optimizer_times = [], []
    step = backend.optimizer_step

    def timed_step() -> float:
        started = time.perf_counter()
        norm: float = step()
        optimizer_times.append(time.perf_counter() - started)
        return norm

    backend.optimizer_step = timed_step
    for i in range(args.steps + 1):
        if torch.cuda.is_available() and args.device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        RLUpdate(backend, config).run(samples, inputs, owners)
        if torch.cuda.is_available() and args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if i > 0:  # the first update warms up (allocations, kernels)
            times.append(time.perf_counter() - started)
    step_s = statistics.median(times)
    tokens = sum(len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples)
    optimizer_bytes = sum(
        t.numel() * t.element_size()
        for state in backend.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    masters = getattr(backend, "masters", None)
    if masters is not None:
        optimizer_bytes += sum(m.numel() * m.element_size() for m in masters.masters)
    cuda = torch.cuda.is_available() and args.device.startswith("cuda")
    mine = {
        "rank": backend.rank,
        "inputs_built": len(inputs),
        "input_mib": input_mib,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # KiB on Linux
    }
    return {
        "backend": "+".join([kind, *levers]),
        "optimizer_step_s": round(statistics.median(optimizer_times[1:] or optimizer_times), 4),
        "trainable_parameters": sum(p.numel() for p in backend.model.parameters() if p.requires_grad),
        "optimizer_state_mib": round(optimizer_bytes / 2**20, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # KiB on Linux
        "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
        "world_size": backend.world_size,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "samples": len(samples),
        "tokens_per_update": tokens,
        "device": args.device,
        "dtype": args.dtype,
        "image": args.image or None,
        "inputs": args.inputs,
        "ranks": collectives.gather_objects(mine, size=backend.world_size),
    }


def _run_config(args: argparse.Namespace, spec: str) -> dict[str, Any] | None:
    kind, _, n = spec.partition(":")
    nproc = int(n or 1)
    if kind.split("+")[0] == "megatron":
        try:
            import dart.train.megatron  # noqa: F401
        except ImportError:
            print(f"skip {spec}: dart.train.megatron is not importable", file=sys.stderr)
            return None
    # Each configuration in a process of its own, so that its peak memory is its own.
    launcher = [] if kind.split("+")[0] == "torch" else [
        "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, *launcher, __file__, "--worker", spec, "--out", str(out), *_forward(args)]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, check=False)
        if proc.returncode != 0:
            print(f"{spec} failed with exit code {proc.returncode}", file=sys.stderr)
            return None
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _forward(args: argparse.Namespace) -> list[str]:
    return [
        "--model", args.model, "--device", args.device, "--dtype", args.dtype, "--samples", str(args.samples),
        "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len), "--steps", str(args.steps),
        "--micro-batch-size", str(args.micro_batch_size), "--threads", str(args.threads),
        "--lora-rank", str(args.lora_rank), "--inputs", args.inputs, "--image", args.image,
        "--samples-file", args.samples_file,
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="checkpoint directory; default: a tiny random Qwen2.5-VL")
    parser.add_argument("--configs", nargs="+", default=["torch", "torch+lora", "fsdp:1", "fsdp:2", "megatron:2"])
    parser.add_argument("--lora-rank", type=int, default=8, help="adapter rank of torch+lora")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed updates (after one warm-up)")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    parser.add_argument("--image", default="", help="WxH: one screenshot of this size per sample (e.g. 1920x1080)")
    parser.add_argument("--inputs", default="share", choices=["share", "all"], help="what each rank builds")
    parser.add_argument("--samples-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        kind, _, n = args.worker.partition(":")
        result = _measure(args, kind, int(n or 1))
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if not args.model:
            from dart.policy.tiny import write_tiny_checkpoint

            args.model = str(Path(tmp) / "tiny")
            write_tiny_checkpoint(args.model, seed=0)
            if args.image:
                _real_pixel_bounds(Path(args.model))
        if args.image:
            width, _, height = args.image.partition("x")
            made = image_samples(
                args.samples, (int(width), int(height)), args.response_len, args.model, Path(tmp) / "store", seed=0
            )
            args.samples_file = str(Path(tmp) / "samples.json")
            Path(args.samples_file).write_text(json.dumps([s.model_dump(mode="json") for s in made]))
        results = []
        for spec in args.configs:
            measured = _run_config(args, spec)
            if measured is not None:
                print(f"{spec}: {measured['step_s']} s/update, {measured['tokens_per_s']} tokens/s", file=sys.stderr)
                for rank in measured["ranks"]:
                    built = f"{rank['input_mib']} MiB of inputs ({rank['inputs_built']} samples)"
                    print(f"  rank {rank['rank']}: {built}, peak RSS {rank['peak_rss_mib']} MiB", file=sys.stderr)
                results.append(measured)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
