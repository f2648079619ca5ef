"""Run under torchrun by test_fsdp.py: five batches through the trainer's rank protocol, rank 1 running out of memory.

Usage: ``torchrun --nproc-per-node 2 oom_worker.py CONFIG_JSON SAMPLES_JSON OUT_DIR``.

Rank 0 trains as the served trainer does (:meth:`TrainerService.train`); rank 1 runs the follower loop
(:func:`dart.train.distributed.follow`). The fault injection is this file's alone (no production switch): rank 1's
sample reader notes which batch it is building (batch k's trajectory ids start ``b<k>-``), and its backend's
``forward_logprobs`` raises ``torch.OutOfMemoryError`` after a real forward pass with gradient (where the
vocabulary-wide log-softmax would run out of memory) as :data:`FAULTS` says. With 4 samples, 1 mini-batch and
micro-batch size 2, each rank owns 2 samples: one micro-step of 2 rows per batch.

- batches 0 and 1: no fault;
- batch 2: rank 1 runs out of memory in its first row with gradient, its third micro-step: every rank runs the
  mini-batch again at micro-batch size 1;
- batch 3: rank 1 runs out of memory in every row with gradient: size 2, then 1, then the batch is given up;
- batch 4: no fault.

Rank 0 writes ``OUT_DIR/rank-0.json``: per batch, its figures (step, loss, grad norm, micro-batch size, retries)
or the error raised (type, reason, rank, retryable, message); rank 1 writes ``OUT_DIR/rank-1.json`` with its
optimizer steps and the faults it raised.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from dart.protocol.messages import TrainingSample
from dart.runtime.lifetime import exit_with_parent
from dart.train.batching import ModelInputs, StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.distributed import follow
from dart.train.fsdp import FsdpBackend
from dart.train.service import TrainerService
from dart.train.update import SampleReader

FAULTS: dict[int, str] = {2: "once", 3: "always"}
"""Batch -> when rank 1's forward passes with gradient run out of memory in it."""
BATCHES = 5


class OutOfMemoryOnRank1:
    """Rank 1's real reader and backend, running out of memory as :data:`FAULTS` says."""

    def __init__(self, backend: FsdpBackend, reader: Any) -> None:
        self.reader, self.forward = reader, backend.forward_logprobs
        self.batch, self.raised = -1, 0
        self.raised_in: dict[int, int] = {}
        backend.forward_logprobs = self.forward_logprobs  # type: ignore[method-assign]  # test-only fault

    def read(self, sample: TrainingSample) -> ModelInputs:
        self.batch = int(sample.trajectory_id.partition("-")[0][1:])
        inputs: ModelInputs = self.reader(sample)
        return inputs

    def forward_logprobs(self, inputs: ModelInputs, **sampling: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.forward(inputs, **sampling)
        when = FAULTS.get(self.batch)
        if torch.is_grad_enabled() and (when == "always" or (when == "once" and self.batch not in self.raised_in)):
            self.raised_in[self.batch] = self.raised_in.get(self.batch, 0) + 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB (injected on rank 1)")
        return out


def main() -> None:
    # A rank left waiting in a collective dies with torchrun's agent (killed when the test times out).
    exit_with_parent()
    config = TrainerConfig.model_validate_json(Path(sys.argv[1]).read_text())
    samples = [TrainingSample.model_validate(s) for s in json.loads(Path(sys.argv[2]).read_text())]
    out = Path(sys.argv[3])
    backend = FsdpBackend.load(config, image_source=StoreImageSource())
    batches = [
        [s.model_copy(update={"trajectory_id": f"b{k}-{s.trajectory_id}"}) for s in samples] for k in range(BATCHES)
    ]
    if backend.rank == 0:
        # Only train() is used: the bus, publisher and consumer are never touched.
        none = cast(Any, None)
        service = TrainerService(config, none, backend, none, none)
        results: list[dict[str, Any]] = []
        for batch in batches:
            try:
                m = service.train(batch)
                results.append(
                    {
                        "step": m.step,
                        "loss": m.loss,
                        "grad_norm": m.grad_norm,
                        "micro_batch_size": m.micro_batch_size,
                        "retried": [asdict(r) for r in m.retried],
                    }
                )
            except Exception as exc:
                fields = {k: getattr(exc, k, None) for k in ("reason", "rank", "retryable", "micro_batch_size")}
                results.append({"error": type(exc).__name__, "message": str(exc), **fields})
        service.commander.send("stop")
        (out / "rank-0.json").write_text(json.dumps({"batches": results, "step": backend.step}))
    else:
        faulty = OutOfMemoryOnRank1(backend, SampleReader(config))
        follow(backend, config, faulty.read)
        (out / "rank-1.json").write_text(json.dumps({"step": backend.step, "raised_in": faulty.raised_in}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
