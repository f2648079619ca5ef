"""torchrun worker of test_megatron_dp.py: the shared RL update on a TP=2 x DP=2 megatron backend (4 ranks).

Usage: ``torchrun --standalone --nproc-per-node 4 megatron_dp_worker.py CONFIG_JSON SAMPLES_JSON OUT_DIR``.

1. Two RL updates (``dart.train.update.RLUpdate``, as the trainer service runs them) in float32; rank 0
   records their metrics and the final Hugging Face weights, which the test compares with one process.
2. One update at lr 1e-6 in float32 and in bfloat16 from the same weights: rank 0 records how far the
   optimizer's tensors (``backend.params``) moved in each.
3. bfloat16 resume: a checkpoint after that step, one more step, back to the checkpoint, the same step
   again: the optimizer's tensors and the published weights must repeat bitwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dart.protocol.messages import TrainingSample
from dart.train.batching import StoreImageSource
from dart.train.config import TrainerConfig
from dart.train.megatron import MegatronBackend
from dart.train.update import RLUpdate, SampleReader


def update(backend: MegatronBackend, config: TrainerConfig, samples: list[TrainingSample]) -> dict[str, object]:
    inputs = [SampleReader(config, StoreImageSource())(s) for s in samples]
    return RLUpdate(backend, config).run(samples, inputs).as_dict()


def snapshot(backend: MegatronBackend) -> torch.Tensor:
    """This rank's optimizer tensors, flattened (float64)."""
    return torch.cat([p.detach().double().flatten() for p in backend.params])


def main() -> None:
    config = TrainerConfig.model_validate(json.loads(Path(sys.argv[1]).read_text()))
    samples = [TrainingSample.model_validate(s) for s in json.loads(Path(sys.argv[2]).read_text())]
    out = Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result: dict[str, object] = {}

    # 1. Two float32 updates at TP=2 x DP=2.
    backend = MegatronBackend.load(config)
    result["layout"] = [backend.tensor_parallel_size, backend.data_parallel_size]
    result["metrics"] = [update(backend, config, samples) for _ in range(2)]
    result["weights"] = backend.full_state_dict()
    backend.close()

    # 2. One update at lr 1e-6, float32 and bfloat16, from the same checkpoint.
    for dtype in ("float32", "bfloat16"):
        small = config.model_copy(update={"lr": 1e-6, "dtype": dtype})
        backend = MegatronBackend.load(small)
        before = snapshot(backend)
        update(backend, small, samples)
        result[f"delta_{dtype}"] = snapshot(backend) - before
        if dtype == "bfloat16":
            # 3. Exact resume of the bfloat16 run.
            backend.save_checkpoint(out / "ckpt")
            update(backend, small, samples)
            after, published = snapshot(backend), backend.full_state_dict()
            backend.load_checkpoint(out / "ckpt")
            update(backend, small, samples)
            again = backend.full_state_dict()
            result["resume_params_bitwise"] = torch.equal(snapshot(backend), after)
            result["resume_published_bitwise"] = all(torch.equal(again[k], published[k]) for k in published)
            result["published_dtypes"] = sorted({str(v.dtype) for v in published.values()})
        backend.close()

    if dist.get_rank() == 0:
        torch.save(result, out / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
