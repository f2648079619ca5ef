"""``dart-train serve --config FILE``: the trainer alone (this package's dependencies only).

Reads the run config's shared sections and ``train`` (see :mod:`dart.runtime.serving`). A backend with
``world_size`` > 1 (FSDP2, megatron-core) is served as that many torchrun ranks: the command launches
this machine's share of them (each runs this module again), global rank 0 serves the trainer, the others
follow it in the backend's collectives; the exit code is the ranks' own. With ``train.backend.nnodes`` > 1
every machine runs this command with its own ``node_rank`` and torchrun's rendezvous joins their ranks.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from dart.runtime.bus import Bus
from dart.runtime.lifetime import exit_with_parent
from dart.runtime.serving import ServeConfig, serve_or_exit, service_main
from dart.runtime.telemetry import Telemetry
from dart.train import __version__
from dart.train.config import NodeSettings, TrainerConfig

STATUS_DIR_ENV = "DART_TRAIN_RANK_STATUS_DIR"


class TrainServeConfig(ServeConfig):
    """What the trainer reads of a run config."""

    train: TrainerConfig = Field(default_factory=TrainerConfig)


async def run_train(config: TrainServeConfig, bus: Bus, telemetry: Telemetry, stop: asyncio.Event) -> None:
    """Train until ``stop`` is set; a training crash surfaces as the exception it is."""
    from dart.runtime.store import open_store
    from dart.train.service import TrainerService

    store = config.store_config()
    trainer = await TrainerService.start(config.train, bus, open_store(store), store_config=store, telemetry=telemetry)
    telemetry.event("service.ready", service="train")
    runner = asyncio.create_task(trainer.run())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
    await trainer.stop()
    stopper.cancel()
    await runner


def torchrun_argv(nodes: NodeSettings) -> list[str]:
    """torchrun's command line (up to the module it runs) for this machine's share of the ranks.

    Raises:
        ValueError: ``nnodes > 1`` without ``rdzv_endpoint``.
    """
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nodes.nproc_per_node}"]
    if nodes.nnodes == 1:
        return [*argv, "--standalone"]
    if nodes.rdzv_endpoint is None:
        raise ValueError(_NEEDS_ENDPOINT.format(nnodes=nodes.nnodes))
    argv += [f"--nnodes={nodes.nnodes}", f"--rdzv-backend={nodes.rdzv_backend}"]
    argv += [f"--rdzv-endpoint={nodes.rdzv_endpoint}", f"--rdzv-id={nodes.rdzv_id}"]
    if nodes.rdzv_backend == "static":
        argv.append(f"--node-rank={nodes.node_rank}")
    else:
        argv.append(f"--rdzv-conf=join_timeout={int(nodes.rdzv_timeout_s)}")
    # One machine's ranks failing is the whole trainer failing: no elastic restarts behind the service's back.
    return [*argv, "--max-restarts=0"]


_NEEDS_ENDPOINT = "nnodes {nnodes} needs rdzv_endpoint (host:port of node 0's rendezvous)"


def launch_ranks(config_file: Path, nodes: NodeSettings, overrides: Sequence[str] = ()) -> int:
    """Run this machine's ``dart-train serve`` ranks under torchrun until they end; returns the exit code.

    SIGTERM/SIGINT are passed on to torchrun, which passes SIGTERM to the ranks: rank 0 stops
    gracefully and tells the others (on every machine) to stop. torchrun itself exits non-zero whenever
    it was signalled, so the code returned is the ranks' own: each records it in a status directory by
    its local rank (missing = failed).
    """
    status = Path(tempfile.mkdtemp(prefix="dart-train-ranks-"))
    argv = [*torchrun_argv(nodes), "-m", "dart.train.serve", "serve", "--config", str(config_file), *overrides]
    proc = subprocess.Popen(argv, env={**os.environ, STATUS_DIR_ENV: str(status)})
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: proc.send_signal(signal.SIGTERM))
    code = proc.wait()
    ranks = [status / f"rank-{r}" for r in range(nodes.nproc_per_node)]
    codes = [int(p.read_text()) if p.is_file() else 1 for p in ranks]
    shutil.rmtree(status, ignore_errors=True)
    return 0 if all(c == 0 for c in codes) else (code or 1)


def record_rank(code: int) -> None:
    """Record this rank's exit code for :func:`launch_ranks` (when it launched this rank), by local rank."""
    directory = os.environ.get(STATUS_DIR_ENV)
    if directory:
        (Path(directory) / f"rank-{os.environ.get('LOCAL_RANK', '0')}").write_text(str(code))


def follow(config: TrainServeConfig) -> None:
    """A non-main rank of a multi-process trainer (started by torchrun): load the backend, follow rank 0."""
    from dart.train.batching import StoreImageSource
    from dart.train.distributed import follow as follow_rank0
    from dart.train.interface import load_backend
    from dart.train.update import SampleReader

    # Only rank 0 stops on SIGTERM (it finishes its batch, then sends ``stop``); a follower leaving
    # first would break the collective rank 0 is in.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.run.torch_threads:
        import torch

        torch.set_num_threads(config.run.torch_threads)
    store = config.store_config()
    retry = config.train.image_reads
    backend = load_backend(config.train, image_source=StoreImageSource(store, retry=retry))
    follow_rank0(backend, config.train, SampleReader(config.train, StoreImageSource(store, retry=retry)))


def _ranks(config: TrainServeConfig, config_file: Path, overrides: Sequence[str]) -> int | None:
    """Before serving: launch the ranks of a multi-process backend, or serve/follow as one of them."""
    backend = config.train.backend
    if not isinstance(backend, NodeSettings) or backend.world_size <= 1:
        return None
    if "RANK" not in os.environ:
        if backend.nnodes > 1 and backend.rdzv_endpoint is None:
            print(f"error: train.backend: {_NEEDS_ENDPOINT.format(nnodes=backend.nnodes)}", file=sys.stderr)
            return 2
        return launch_ranks(config_file, backend, overrides)
    # torchrun starts each rank in its own session: a SIGKILL of its agent would leave ranks waiting in a
    # collective forever, so each rank goes when the agent goes.
    exit_with_parent()
    code = 1  # stays 1 when following raises
    try:
        if os.environ["RANK"] != "0":
            follow(config)
            code = 0
        else:
            code = serve_or_exit("train", config, run_train, version=__version__)
    finally:
        record_rank(code)
    return code


def command(argv: Sequence[str] | None = None) -> int:
    """``dart-train serve --config FILE`` with ``argv`` (default: the process's); returns the exit code."""
    return service_main("train", TrainServeConfig, run_train, version=__version__, argv=argv, before=_ranks)


def main() -> None:
    sys.exit(command())


if __name__ == "__main__":
    main()
