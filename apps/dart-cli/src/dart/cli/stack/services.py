"""Start and stop one DART service from a run config: the code behind ``dart serve``.

Lifecycle of a served service: ``telemetry set up -> bus connected -> service started -> running``
until SIGINT/SIGTERM ``-> service stopped gracefully -> bus drained -> telemetry flushed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dart.cli.stack.config import RunConfig, ServiceName, load_tasks, store_config
from dart.protocol.bus import Bus
from dart.protocol.store import open_store
from dart.protocol.telemetry import Telemetry, TelemetryConfig, setup_telemetry

log = logging.getLogger(__name__)


def service_telemetry(config: RunConfig, service: ServiceName) -> Telemetry:
    """Telemetry of one service, writing ``<run_dir>/telemetry/<service>.jsonl``."""
    from dart.cli import __version__

    tel_config: TelemetryConfig = config.telemetry
    if config.run.run_dir is not None and tel_config.jsonl_path is None:
        tel_config = tel_config.model_copy(update={"jsonl_path": config.run.run_dir / "telemetry" / f"{service}.jsonl"})
    if config.run.run_dir is not None and tel_config.run_dir is None:
        tel_config = tel_config.model_copy(update={"run_dir": config.run.run_dir})  # trackers write under it
    return setup_telemetry(f"dart-{service}", version=__version__, run_id=config.run.name, config=tel_config)


STATUS_DIR_ENV = "DART_TRAIN_RANK_STATUS_DIR"


def launch_trainer_ranks(config_file: Path, nproc: int) -> int:
    """Run ``dart serve train`` as ``nproc`` torchrun ranks until they end; returns the exit code.

    SIGTERM/SIGINT are passed on to torchrun, which passes SIGTERM to the ranks: rank 0 stops
    gracefully and tells the others to stop. torchrun itself exits non-zero whenever it was signalled,
    so the code returned is the ranks' own: each records it in a status directory (missing = failed).
    """
    status = Path(tempfile.mkdtemp(prefix="dart-train-ranks-"))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    argv += ["-m", "dart.cli", "serve", "train", "--config", str(config_file)]
    proc = subprocess.Popen(argv, env={**os.environ, STATUS_DIR_ENV: str(status)})
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: proc.send_signal(signal.SIGTERM))
    code = proc.wait()
    ranks = [status / f"rank-{r}" for r in range(nproc)]
    codes = [int(p.read_text()) if p.is_file() else 1 for p in ranks]
    shutil.rmtree(status, ignore_errors=True)
    return 0 if all(c == 0 for c in codes) else (code or 1)


@contextlib.contextmanager
def rank_status() -> Iterator[None]:
    """Record this rank's outcome (0, or 1 on an exception) for :func:`launch_trainer_ranks`."""
    code = 1
    try:
        yield
        code = 0
    finally:
        directory = os.environ.get(STATUS_DIR_ENV)
        if directory:
            (Path(directory) / f"rank-{os.environ.get('RANK', '0')}").write_text(str(code))


def follow_trainer(config: RunConfig) -> None:
    """A non-main rank of a multi-process trainer (started by torchrun): load the backend, follow rank 0."""
    from dart.train.batching import StoreImageSource
    from dart.train.distributed import follow
    from dart.train.interface import load_backend
    from dart.train.update import SampleReader

    # Only rank 0 stops on SIGTERM (it finishes its batch, then sends ``stop``); a follower leaving
    # first would break the collective rank 0 is in.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.run.torch_threads:
        import torch

        torch.set_num_threads(config.run.torch_threads)
    scfg = store_config(config)
    backend = load_backend(config.train, image_source=StoreImageSource(scfg))
    follow(backend, config.train, SampleReader(config.train, StoreImageSource(scfg)))


async def serve(config: RunConfig, service: ServiceName, stop: asyncio.Event | None = None) -> None:
    """Run one service until ``stop`` is set or the process gets SIGINT/SIGTERM."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    if config.run.torch_threads:
        with contextlib.suppress(ImportError):
            import torch

            torch.set_num_threads(config.run.torch_threads)
    telemetry = service_telemetry(config, service)
    bus_config = config.bus.model_copy(update={"run": config.run.name, "name": f"dart-{service}"})
    try:
        with telemetry.activate():
            telemetry.event("service.start", service=service)
            bus = await Bus.connect(bus_config, tracer_provider=telemetry.tracer_provider)
            try:
                await _run_service(config, service, bus, telemetry, stop)
            finally:
                await bus.drain()
            telemetry.event("service.stop", service=service)
    finally:
        telemetry.shutdown()


async def _run_service(
    config: RunConfig, service: ServiceName, bus: Bus, telemetry: Telemetry, stop: asyncio.Event
) -> None:
    handle: Any
    if service == "env":
        from dart.env.service import EnvService

        handle = EnvService(config.env, bus, telemetry=telemetry, store=open_store(store_config(config)))
        await handle.start()
        await stop.wait()
        await handle.stop()
    elif service == "data":
        from dart.data import DataService

        store = open_store(store_config(config))
        handle = DataService(config.data, bus, store, load_tasks(config), telemetry)
        await handle.start()
        await stop.wait()
        await handle.stop()
    elif service == "train":
        from dart.train.service import TrainerService

        scfg = store_config(config)
        handle = await TrainerService.start(config.train, bus, open_store(scfg), store_config=scfg, telemetry=telemetry)
        runner = asyncio.create_task(handle.run())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        await handle.stop()
        stopper.cancel()
        await runner  # surfaces a training crash instead of hiding it
    elif service == "rollout":
        from dart.rollout.service import RolloutService

        handle = RolloutService(config.rollout, bus, telemetry=telemetry, store_config=store_config(config))
        await handle.start()
        telemetry.event("service.ready", service=service)  # engines are up: `dart run` starts its RL clock
        await stop.wait()
        await handle.stop()
    else:  # pragma: no cover - typer restricts the choice
        raise ValueError(f"unknown service {service!r}")
