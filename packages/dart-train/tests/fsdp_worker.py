"""Run under torchrun by test_fsdp.py: 3 updates with the fsdp backend, then a checkpoint resume.

Usage: ``torchrun --nproc-per-node N fsdp_worker.py CONFIG_JSON SAMPLES_JSON OUT_DIR``. Rank 0 writes
``OUT_DIR/result.pt``: per-step metrics, the first step's full gradients, the final published weights (the full
state dict, or the adapters under LoRA), those of a run resumed from the step-2 checkpoint, and those of a
backend that trained a step and then took the final published weights (``load_published``), with its moment count.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dart.protocol.messages import TrainingSample
from dart.train.batching import StoreImageSource
from dart.train.checkpoint import load_checkpoint, save_checkpoint
from dart.train.config import TrainerConfig
from dart.train.fsdp import FsdpBackend
from dart.train.update import RLUpdate, SampleReader


def main() -> None:
    config = TrainerConfig.model_validate_json(Path(sys.argv[1]).read_text())
    samples = [TrainingSample.model_validate(s) for s in json.loads(Path(sys.argv[2]).read_text())]
    out = Path(sys.argv[3])
    backend = FsdpBackend.load(config, image_source=StoreImageSource())
    inputs = [SampleReader(config)(s) for s in samples]
    grads: dict[str, torch.Tensor] = {}
    step = backend.optimizer_step

    def capture() -> float:
        if not grads:
            for name, p in backend.model.named_parameters():
                if p.grad is not None:
                    grads[name] = p.grad.full_tensor().cpu().clone()
        return step()

    backend.optimizer_step = capture  # type: ignore[method-assign]
    metrics = []
    for i in range(3):
        metrics.append(RLUpdate(backend, config).run(samples, inputs).as_dict())
        if i == 1:
            save_checkpoint(backend, out / "step-2", version=2)
    final = backend.published_weights()[0]
    resumed = FsdpBackend.load(config, image_source=StoreImageSource())
    state = load_checkpoint(resumed, out / "step-2")
    resumed_metrics = RLUpdate(resumed, config).run(samples, inputs).as_dict()
    resumed_final = resumed.published_weights()[0]
    # A restart without a checkpoint takes the published weights: rank 0 read them, the others get their shards.
    taken = FsdpBackend.load(config, image_source=StoreImageSource())
    RLUpdate(taken, config).run(samples, inputs)  # moments to discard
    taken.load_published(final if dist.get_rank() == 0 else {})
    taken_moments = len(taken.optimizer.state)
    taken_final = taken.published_weights()[0]
    if dist.get_rank() == 0:
        torch.save(
            {
                "metrics": metrics,
                "grads": grads,
                "final": final,
                "resumed_step": state.step,
                "resumed_metrics": resumed_metrics,
                "resumed_final": resumed_final,
                "taken_moments": taken_moments,
                "taken_final": taken_final,
            },
            out / "result.pt",
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
