"""Run under torchrun by test_fsdp.py: three batches through the trainer's rank protocol, a fault on one rank each.

Usage: ``torchrun --nproc-per-node 2 rank_fault_worker.py CONFIG_JSON SAMPLES_JSON OUT_DIR``.

Rank 0 trains as the served trainer does (:meth:`TrainerService.train`: broadcast the command, build
inputs, update); rank 1 runs the follower loop (:func:`dart.train.distributed.follow`). The fault
injection is this file's alone (no production switch): each rank's sample reader is wrapped so that it
raises on the batches :data:`FAULTS` lists for that rank. Batch 0 fails on rank 1 only (a screenshot
store that stayed unreadable), batch 1 on rank 0 only (an unusable sample), batch 2 nowhere.

Rank 0 writes ``OUT_DIR/rank-0.json``: per batch, the step reached or the error raised (type, reason,
rank, detail, retryable); rank 1 writes ``OUT_DIR/rank-1.json`` with its optimizer steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

from dart.protocol.lifetime import exit_with_parent
from dart.protocol.messages import TrainingSample
from dart.train.batching import ModelInputs, StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.distributed import follow
from dart.train.errors import ImageFetchError, SampleError
from dart.train.fsdp import FsdpBackend
from dart.train.service import TrainerService
from dart.train.update import SampleReader

FAULTS: dict[int, set[int]] = {1: {0}, 0: {1}}
"""Rank -> the batches on which its reader fails."""


class FaultyReader:
    """A rank's real sample reader, failing on this rank's faulty batches (batch k's trajectory ids start ``b<k>-``)."""

    def __init__(self, reader: Any, rank: int) -> None:
        self.reader, self.rank = reader, rank

    def __call__(self, sample: TrainingSample) -> ModelInputs:
        batch = int(sample.trajectory_id.split("-")[0][1:])
        if batch in FAULTS.get(self.rank, set()):
            if self.rank == 0:
                raise SampleError(sample.trajectory_id, sample.step_index, f"fault injected on rank {self.rank}")
            raise ImageFetchError(sample.images[0].uri, f"fault injected on rank {self.rank}")
        inputs: ModelInputs = self.reader(sample)
        return inputs


def main() -> None:
    # A rank left waiting in a collective dies with torchrun's agent (killed when the test times out).
    exit_with_parent()
    config = TrainerConfig.model_validate_json(Path(sys.argv[1]).read_text())
    samples = [TrainingSample.model_validate(s) for s in json.loads(Path(sys.argv[2]).read_text())]
    out = Path(sys.argv[3])
    backend = FsdpBackend.load(config, image_source=StoreImageSource())
    batches = [[s.model_copy(update={"trajectory_id": f"b{k}-{s.trajectory_id}"}) for s in samples] for k in range(3)]
    if backend.rank == 0:
        # Only train() is used: the bus, publisher and consumer are never touched.
        none = cast(Any, None)
        service = TrainerService(config, none, backend, none, none)
        service.reader = FaultyReader(service.reader, 0)  # type: ignore[assignment]  # test-only fault injection
        results: list[dict[str, Any]] = []
        for batch in batches:
            try:
                results.append({"step": service.train(batch).step})
            except Exception as exc:
                fields = {k: getattr(exc, k, None) for k in ("reason", "rank", "detail", "retryable")}
                results.append({"error": type(exc).__name__, **fields})
        service.commander.send("stop")
        (out / "rank-0.json").write_text(json.dumps({"batches": results, "step": backend.step}))
    else:
        follow(backend, config, FaultyReader(SampleReader(config), backend.rank))
        (out / f"rank-{backend.rank}.json").write_text(json.dumps({"step": backend.step}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
