"""Run under torchrun by test_fsdp.py: four batches through the trainer's rank protocol, with faults.

Usage: ``torchrun --nproc-per-node 2 rank_fault_worker.py CONFIG_JSON SAMPLES_JSON OUT_DIR``.

Rank 0 trains as the served trainer does (:meth:`TrainerService.train`: send the command, build its share of
the inputs, agree, update); rank 1 runs the follower loop (:func:`dart.train.distributed.follow`). The fault
injection is this file's alone (no production switch): each rank's sample reader is wrapped so that it raises
on what :data:`FAULTS` lists for that rank. With 2 samples and 1 mini-batch, rank r owns sample r.

- batch 0: rank 1 cannot read its sample's screenshot (the store stayed unreadable): the batch goes back whole;
- batch 1: rank 0's sample is unusable (tokens and images disagree): dropped alone, the batch trains on the
  other (rank 0, left with no sample of its own, builds that one too, to run as a weight-0 row);
- batch 2: the same fault, but the batch was formed for 2 samples (``min_samples``): too few left;
- batch 3: no fault.

Rank 0 writes ``OUT_DIR/rank-0.json``: per batch, the step reached and samples dropped, or the error raised
(type, reason, rank, detail, retryable); rank 1 writes ``OUT_DIR/rank-1.json`` with its optimizer steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

from dart.protocol.messages import TrainingSample
from dart.runtime.lifetime import exit_with_parent
from dart.train.batching import ModelInputs, StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.distributed import follow
from dart.train.errors import ImageFetchError, SampleError
from dart.train.fsdp import FsdpBackend
from dart.train.service import TrainerService
from dart.train.update import SampleReader

FAULTS: dict[int, dict[int, type[Exception]]] = {1: {0: ImageFetchError}, 0: {1: SampleError, 2: SampleError}}
"""Rank -> batch -> the error its reader raises on its own sample of that batch."""
MIN_SAMPLES = {2: 2}
"""Batch -> the min_samples it was formed for (None elsewhere)."""


class FaultyReader:
    """A rank's real sample reader, failing on its own sample (trajectory ``own``) of this rank's faulty batches
    (batch k's trajectory ids start ``b<k>-``)."""

    def __init__(self, reader: Any, rank: int, own: str) -> None:
        self.reader, self.rank, self.own = reader, rank, own

    def __call__(self, sample: TrainingSample) -> ModelInputs:
        prefix, _, trajectory = sample.trajectory_id.partition("-")
        error = FAULTS.get(self.rank, {}).get(int(prefix[1:]))
        if error is SampleError and trajectory == self.own:
            raise SampleError(sample.trajectory_id, sample.step_index, f"fault injected on rank {self.rank}")
        if error is ImageFetchError and trajectory == self.own:
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
    batches = [[s.model_copy(update={"trajectory_id": f"b{k}-{s.trajectory_id}"}) for s in samples] for k in range(4)]
    if backend.rank == 0:
        # Only train() is used: the bus, publisher and consumer are never touched.
        none = cast(Any, None)
        service = TrainerService(config, none, backend, none, none)
        service.reader = FaultyReader(service.reader, 0, samples[0].trajectory_id)  # type: ignore[assignment]  # test-only faults
        results: list[dict[str, Any]] = []
        for k, batch in enumerate(batches):
            try:
                metrics = service.train(batch, MIN_SAMPLES.get(k))
                results.append({"step": metrics.step, "samples": metrics.samples, "dropped": metrics.dropped_by_reason})
            except Exception as exc:
                fields = {k: getattr(exc, k, None) for k in ("reason", "rank", "detail", "retryable")}
                results.append({"error": type(exc).__name__, **fields})
        service.commander.send("stop")
        (out / "rank-0.json").write_text(json.dumps({"batches": results, "step": backend.step}))
    else:
        follow(backend, config, FaultyReader(SampleReader(config), backend.rank, samples[backend.rank].trajectory_id))
        (out / f"rank-{backend.rank}.json").write_text(json.dumps({"step": backend.step}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
