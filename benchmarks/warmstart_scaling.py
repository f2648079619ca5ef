"""What it takes for the tiny policy to generalize: held-out success after supervised warm start.

The quickstart's policy memorizes its training layouts and solves almost none of the held-out ones
(issue 12). This script separates the suspects: the number of distinct training layouts, the
model's size, and the number of SFT samples. Each configuration writes a tiny Qwen2.5-VL of the
given size, records oracle demonstrations on ``layouts`` sim tasks per family (layout seeds from
2000, the ``train`` split's range: its 16 per family are the first 16 here, and no seed reaches
the held-out split's 3000), runs SFT, and evaluates greedily (the hf engine, the rollout's prompt
builder and action parser) on the 32 ``builtin:heldout`` tasks and on 32 of its own training tasks,
at a few points during training, and the NLL of the oracle's actions on the held-out screens (a
continuous measure of generalization, which moves before held-out successes do).

Usage::

    uv run python benchmarks/warmstart_scaling.py --device cpu --configs tiny:16:120:16
    python benchmarks/warmstart_scaling.py --device cuda --configs tiny:16:400:16 tiny:250:400:16

A configuration is ``SPEC:LAYOUTS_PER_FAMILY:STEPS:BATCH[:LR]`` with SPEC one of :data:`SPECS`.
The last line of the output is one JSON object with every configuration's curve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dart.cli.stack.warmstart import record_demos
from dart.env.service.config import EnvServiceConfig
from dart.env.sim import SimEnv
from dart.env.sim.catalog import generate_suite, load_builtin_suite
from dart.policy.action_grammar import parse_action
from dart.policy.config import PromptConfig
from dart.policy.loading import load_policy
from dart.policy.prompt import HistoryStep, build_prompt
from dart.policy.tiny import write_tiny_checkpoint
from dart.policy.tiny_spec import TinyModelSpec
from dart.protocol.messages import Finished, Sampling, TaskSpec
from dart.rollout.engine.hf import HFEngine, HFEngineConfig
from dart.rollout.engine.interface import GenerationRequest
from dart.train.batching import InputBuilder, ModelInputs

SPECS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "small": TinyModelSpec(
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=768,
        vision_hidden_size=192,
        vision_depth=4,
        vision_heads=4,
        vision_intermediate_size=512,
    ),
    "tiny448": TinyModelSpec(image_size=448),
}
"""Model sizes: ``tiny`` is the quickstart's (``dart model init-tiny`` defaults); ``tiny448`` the same model
shown the 224 x 224 sim screens upscaled to 448 x 448 (256 image tokens instead of 64)."""

TRAIN_SEED = 2
"""generate_suite seed of the training layouts (seeds 2000 + i), the ``train`` split's."""

MAX_NEW_TOKENS = 48
"""As the quickstart's runners."""


@dataclass(frozen=True)
class Config:
    """One configuration: model size, distinct layouts, SFT steps, batch and learning rate."""

    spec: str
    layouts: int
    steps: int
    batch: int
    lr: float = 3e-3

    @classmethod
    def parse(cls, text: str) -> Config:
        """``SPEC:LAYOUTS:STEPS:BATCH[:LR]``."""
        parts = text.split(":")
        if len(parts) not in (4, 5) or parts[0] not in SPECS:
            raise argparse.ArgumentTypeError(f"expected SPEC:LAYOUTS:STEPS:BATCH[:LR] with SPEC in {sorted(SPECS)}")
        lr = float(parts[4]) if len(parts) == 5 else 3e-3
        return cls(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), lr)

    @property
    def name(self) -> str:
        """Short label."""
        return f"{self.spec}:{self.layouts}:{self.steps}:{self.batch}:{self.lr:g}"


def _batch_forward(model: Any, rows: list[ModelInputs], device: str, dtype: torch.dtype) -> torch.Tensor:
    """Token-mean response NLL of a right-padded batch (one forward pass)."""
    width = max(r.input_ids.shape[1] for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    mm = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(rows):
        n = r.input_ids.shape[1]
        ids[i, :n] = r.input_ids[0]
        mask[i, :n] = 1
        mm[i, :n] = r.mm_token_type_ids[0]
        labels[i, r.prompt_len : n] = r.input_ids[0, r.prompt_len :]
    pixels = torch.cat([r.pixel_values for r in rows if r.pixel_values is not None])
    grids = torch.cat([r.image_grid_thw for r in rows if r.image_grid_thw is not None])
    logits = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        mm_token_type_ids=mm.to(device),
        pixel_values=pixels.to(device=device, dtype=dtype),
        image_grid_thw=grids.to(device),
        use_cache=False,
    ).logits
    # Position t predicts token t + 1.
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1).to(device), ignore_index=-100
    )


def _mean_nll(model: Any, rows: list[ModelInputs], device: str, dtype: torch.dtype) -> float:
    """Token-mean response NLL of ``rows`` (no gradient), in batches of 16."""
    total = tokens = 0.0
    with torch.no_grad():
        for lo in range(0, len(rows), 16):
            chunk = rows[lo : lo + 16]
            n = sum(r.response_len for r in chunk)
            total += float(_batch_forward(model, chunk, device, dtype)) * n
            tokens += n
    return total / tokens


async def _episode(engine: HFEngine, task: TaskSpec, image_size: int) -> bool:
    """One greedy episode of ``task`` on its own sim instance; True on success.

    The rollout runner's loop without the bus and the env service (so the script runs on a bare GPU
    machine), and a little stricter: an unparseable answer ends the episode here, where the runner lets
    the policy answer again. Every figure in docs/benchmarks.md was measured with this loop.
    """
    env = SimEnv()
    await env.start()
    try:
        observation, instruction = await env.reset(task)
        history: list[HistoryStep] = []
        for _ in range(task.max_steps):
            prompt = build_prompt(instruction, observation.screenshot, history, max_images=1, image_size=image_size)
            result = await engine.generate(
                GenerationRequest(prompt, max_new_tokens=MAX_NEW_TOKENS, sampling=Sampling(temperature=0.0))
            )
            parsed = parse_action(result.text)
            history.append(HistoryStep(result.text))
            if parsed.action is None or isinstance(parsed.action, Finished):
                break
            observation, done, _ = await env.step(parsed.action)
            if done:
                break
        _, success, _ = await env.evaluate()
        return success
    finally:
        await env.close()


async def _success(model: Any, processor: Any, tasks: list[TaskSpec], device: str, image_size: int) -> float:
    engine = HFEngine(HFEngineConfig(model_path="-", device=device, max_batch_size=64), model, processor)
    try:
        outcomes = await asyncio.gather(*(_episode(engine, t, image_size) for t in tasks))
    finally:
        await engine.close()
    return sum(outcomes) / len(tasks)


def run_config(
    config: Config, *, device: str, dtype: torch.dtype, workdir: Path, evals: int, seed: int, max_train_s: float
) -> dict[str, Any]:
    """Warm-start one configuration and evaluate it ``evals`` times along the way.

    Training stops early, with a last evaluation, once its optimizer steps have taken ``max_train_s``.
    """
    started = time.monotonic()
    torch.manual_seed(seed)
    path = workdir / config.spec
    if not path.exists():
        write_tiny_checkpoint(path, seed=0, spec=SPECS[config.spec])
    model, processor = load_policy(str(path), dtype=dtype, device=device)
    image_size = SPECS[config.spec].image_size
    builder = InputBuilder(processor, model.config.image_token_id)

    def demo_rows(suite: list[TaskSpec]) -> list[ModelInputs]:
        demos, _ = asyncio.run(
            record_demos(
                suite,
                processor,
                env_config=EnvServiceConfig(backend="sim"),
                episodes_per_task=1,
                prompt=PromptConfig(max_images=1, image_size=image_size),
                seed=seed,
            )
        )
        return [builder.build(d.prompt_token_ids, d.response_token_ids, d.images) for d in demos]

    tasks = list(generate_suite("train", per_family=config.layouts, difficulties=("easy",), seed=TRAIN_SEED).tasks)
    rows = demo_rows(tasks)
    heldout = list(load_builtin_suite("heldout").tasks)
    # The oracle's actions on the held-out screens: their NLL measures generalization before any success does.
    heldout_rows = demo_rows(heldout)
    record_s = time.monotonic() - started
    by_family: dict[str, list[TaskSpec]] = {}
    for task in tasks:
        by_family.setdefault(str(task.params["family"]), []).append(task)
    seen = [t for family in by_family.values() for t in family[:8]]
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    rng = random.Random(seed)
    checkpoints = {round(config.steps * (i + 1) / evals) for i in range(evals)}
    curve: list[dict[str, float]] = []
    train_s = 0.0
    loss = float("nan")
    for step in range(1, config.steps + 1):
        t0 = time.monotonic()
        model.train()
        nll = _batch_forward(model, rng.sample(rows, min(config.batch, len(rows))), device, dtype)
        optimizer.zero_grad(set_to_none=True)
        nll.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss = float(nll.detach())
        train_s += time.monotonic() - t0
        out_of_time = train_s > max_train_s
        if step in checkpoints or out_of_time:
            model.eval()
            with torch.inference_mode():
                point = {
                    "step": step,
                    "loss": round(loss, 4),
                    "heldout_nll": round(_mean_nll(model, heldout_rows, device, dtype), 4),
                    "heldout": asyncio.run(_success(model, processor, heldout, device, image_size)),
                    "train": asyncio.run(_success(model, processor, seen, device, image_size)),
                    "samples": step * config.batch,
                }
            curve.append(point)
            print(
                f"  {config.name} step {step}: loss {loss:.3f} held-out nll {point['heldout_nll']:.3f} "
                f"success {point['heldout']:.3f} "
                f"train {point['train']:.3f}",
                flush=True,
            )
            if out_of_time:
                break
    return {
        "config": asdict(config) | {"name": config.name},
        "parameters": sum(p.numel() for p in model.parameters()),
        "demos": len(rows),
        "record_s": round(record_s, 1),
        "train_s": round(train_s, 1),
        "steps_done": step,
        "s_per_step": round(train_s / step, 4),
        "curve": curve,
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Run each configuration in turn; print a table and one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", type=Config.parse, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--evals", type=int, default=4, help="evaluations per configuration, evenly spaced")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-train-s", type=float, default=float("inf"), help="cap on each configuration's SFT time")
    parser.add_argument("--out", type=Path, default=None, help="also append each result to this JSONL file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.backends.cuda.matmul.allow_tf32 = True
    results = []
    with tempfile.TemporaryDirectory(prefix="dart-ws-scaling-") as tmp:
        for config in args.configs:
            result = run_config(
                config,
                device=args.device,
                dtype=dtype,
                workdir=Path(tmp),
                evals=args.evals,
                seed=args.seed,
                max_train_s=args.max_train_s,
            )
            results.append(result)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(json.dumps(result) + "\n")
    print("| config | params | demos | s/step | step | loss | held-out nll | held-out | train |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        for p in r["curve"]:
            print(
                f"| {r['config']['name']} | {r['parameters']} | {r['demos']} | {r['s_per_step']} | {p['step']} | "
                f"{p['loss']} | {p['heldout_nll']} | {p['heldout']:.3f} | {p['train']:.3f} |"
            )
    print(json.dumps({"device": args.device, "dtype": args.dtype, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
