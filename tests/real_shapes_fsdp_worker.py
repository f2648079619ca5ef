"""Run under torchrun by test_real_shapes.py: the FSDP2 backend's recomputed log-probs of the given samples.

Usage: ``torchrun --nproc-per-node N real_shapes_fsdp_worker.py CONFIG_JSON SAMPLES_JSON OUT_DIR``; rank 0
writes ``OUT_DIR/logprobs.json`` (one list of floats per sample).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from dart.protocol.messages import TrainingSample
from dart.train.batching import StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.fsdp import FsdpBackend


def main() -> None:
    config = TrainerConfig.model_validate_json(Path(sys.argv[1]).read_text())
    samples = [TrainingSample.model_validate(s) for s in json.loads(Path(sys.argv[2]).read_text())]
    backend = FsdpBackend.load(config, image_source=StoreImageSource())
    logps = [logp.tolist() for logp in backend.compute_logprobs(samples)]
    if dist.get_rank() == 0:
        (Path(sys.argv[3]) / "logprobs.json").write_text(json.dumps(logps))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
