"""Run under torchrun by test_megatron.py: a megatron TP=2 trainer that has no batch for longer than its
collective timeout, then trains one.

Usage: ``torchrun --nproc-per-node 2 idle_worker.py CONFIG_JSON SAMPLES_JSON OUT_DIR IDLE_S``.

Rank 0 waits ``IDLE_S`` seconds (as a served trainer does while the engines fill a batch), then trains as
the served trainer does (:meth:`TrainerService.train`) and sends ``stop``; rank 1 runs the follower loop
(:func:`dart.train.distributed.follow`), waking every second on the store. Each rank writes
``OUT_DIR/rank-<r>.json`` with its optimizer steps.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

from dart.protocol.lifetime import exit_with_parent
from dart.protocol.messages import TrainingSample
from dart.train.batching import StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.distributed import follow
from dart.train.megatron.backend import MegatronBackend
from dart.train.service import TrainerService
from dart.train.update import SampleReader


def main() -> None:
    exit_with_parent()  # a rank left waiting dies with torchrun's agent (killed when the test times out)
    config = TrainerConfig.model_validate_json(Path(sys.argv[1]).read_text())
    samples = [TrainingSample.model_validate(s) for s in json.loads(Path(sys.argv[2]).read_text())]
    out, idle_s = Path(sys.argv[3]), float(sys.argv[4])
    backend = MegatronBackend.load(config, image_source=StoreImageSource())
    if backend.rank == 0:
        time.sleep(idle_s)
        none = cast(Any, None)  # only train() is used: the bus, publisher and consumer are never touched
        service = TrainerService(config, none, backend, none, none)
        step = service.train(samples).step
        service.commander.send("stop")
        (out / "rank-0.json").write_text(json.dumps({"step": step}))
    else:
        follow(backend, config, SampleReader(config), wait_s=1.0)
        (out / f"rank-{backend.rank}.json").write_text(json.dumps({"step": backend.step}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
