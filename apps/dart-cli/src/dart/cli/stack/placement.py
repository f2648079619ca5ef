"""Where ``dart run``'s processes run on the machine's GPUs: the devices each one is given.

The plan is computed from the run config before anything starts, in this order, each taking the next free
GPUs (``CUDA_VISIBLE_DEVICES`` indices of the machine):

- the trainer, when ``train.device`` is CUDA: one GPU per rank this machine runs (``nproc`` of fsdp or a
  registered backend, ``tensor_parallel_size x data_parallel_size / nnodes`` of megatron, 1 of torch). Its
  service process sees them all and rank ``r`` takes ``cuda:r`` among them;
- each launched vLLM server, when the run has GPUs: ``launch.tensor_parallel_size`` of them, its own
  (``launch.devices``, which the rollout service turns into each server's ``CUDA_VISIBLE_DEVICES``). On a
  machine with none the servers are a CPU build and take none;
- each hf engine, when ``rollout.engine.device`` is CUDA: one (the rollout service process sees them, engine
  ``i`` takes ``cuda:i`` among them).

The GPUs counted are ``run.gpus`` when set (declared: a plan for a machine this one stands in for), else what
torch sees here. When ``dart run`` was itself given ``CUDA_VISIBLE_DEVICES``, those are the machine's GPUs
and the plan hands them out. A plan that needs more is refused before anything is written, unless
``run.share_gpus`` lets processes share them (each one's own GPUs still distinct; one GPU: everything on it).
The held-out validator's own engine (``validation.engine``) and the warm start run in the ``dart run`` process
and are not placed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from pydantic import BaseModel, ConfigDict

from dart.cli.stack.config import RunConfig, ServiceName
from dart.protocol.errors import ConfigError
from dart.rollout.engine.hf_config import HFEngineConfig
from dart.rollout.engine.vllm_config import VLLMEngineConfig
from dart.train.config import NodeSettings

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
"""The environment variable a process's GPUs are given in."""


class ProcessPlacement(BaseModel):
    """The GPUs one process of the run is given."""

    model_config = ConfigDict(frozen=True)

    service: ServiceName
    """The service the process belongs to (``train``, ``rollout``)."""
    process: str
    """Which process: ``trainer``, ``vllm-engine-<i>`` (a launched server), ``hf-engine-<i>`` (an engine in
    the rollout service process)."""
    node: int
    """The machine: this one, or the trainer's ``train.backend.node_rank``."""
    devices: tuple[int, ...]
    """GPU indices of the machine, in the order the process sees them."""
    host: str | None = None
    """The Ray node it runs on (a ``--ray local`` node's name, else ``<ip>/<node id>``); None for ``dart run``'s
    own processes."""
    attempt: int = 1
    """Which start of its service this is (a Ray run places a restarted service anew)."""


class Placement(BaseModel):
    """The run's GPUs and who has which; see the module docstring."""

    model_config = ConfigDict(frozen=True)

    gpus: int
    """GPUs the plan counted on (``run.gpus``, or torch's count)."""
    processes: tuple[ProcessPlacement, ...] = ()
    """Every process given GPUs, in the order they were assigned."""

    def service_environment(self, service: ServiceName) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES`` of ``service``'s own process: the GPUs of its placed processes that run in
        it (the trainer's ranks, hf engines; not launched vLLM servers, which get theirs from
        :meth:`vllm_devices`), each once; empty where it has none."""
        placed = [d for p in self.processes if p.service == service and not _server(p) for d in p.devices]
        # Once each: shared GPUs repeat in the cyclic order they were handed out in, and hf engine i takes
        # visible GPU i mod their count, which is the GPU it was given.
        devices = list(dict.fromkeys(placed))
        return {VISIBLE_DEVICES: ",".join(str(d) for d in devices)} if devices else {}

    def vllm_devices(self) -> list[list[int]]:
        """The GPUs of each launched vLLM server, in engine order (``rollout.engine.launch.devices``)."""
        return [list(p.devices) for p in self.processes if _server(p)]


def visible_gpus() -> int:
    """GPUs torch sees on this machine (0 without CUDA); torch is imported only here, when a plan needs the count."""
    import torch

    return int(torch.cuda.device_count())


Want = tuple[ServiceName, str, int, int]
"""One process's need: service, process (``trainer``, ``vllm-engine-<i>``, ``hf-engine-<i>``), node, GPUs."""


def demand(
    config: RunConfig,
    *,
    has_gpus: bool,
    every_node: bool = False,
    gpus_per_rank: int | None = None,
    gpus_per_engine: int | None = None,
) -> list[Want]:
    """The GPUs each process of ``config`` needs, in the order they are handed out (see the module docstring).

    Args:
        config: The run config.
        has_gpus: Whether the machine (or cluster) has any: launched vLLM servers are a CPU build without.
        every_node: One trainer entry per node its ranks span (a cluster places them all); else only this
            machine's (``train.backend.node_rank``).
        gpus_per_rank: GPUs per trainer rank, replacing what ``train.device`` implies (1 on CUDA, else 0).
        gpus_per_engine: GPUs per engine, replacing what the engine implies (a launched vLLM server's
            ``launch.tensor_parallel_size``, 1 for an hf engine on CUDA, else 0). Both are a Ray cluster's
            ``cluster.gpus``: logical GPUs asked even for processes that compute on the CPU.
    """
    wanted: list[Want] = []
    backend = config.train.backend
    ranks, nnodes = (backend.nproc_per_node, backend.nnodes) if isinstance(backend, NodeSettings) else (1, 1)
    per_rank = gpus_per_rank if gpus_per_rank is not None else int(_is_cuda(config.train.device))
    if per_rank:
        nodes = range(nnodes) if every_node else [_node_rank(config)]
        wanted += [("train", "trainer", node, ranks * per_rank) for node in nodes]
    # No engine configured: dart run gives the rollout service hf engines (``finalize``).
    engine, engines = config.rollout.engine or HFEngineConfig(), config.rollout.num_engines
    per_engine, kind = 0, ""
    if isinstance(engine, VLLMEngineConfig) and engine.launch is not None and has_gpus:
        per_engine, kind = engine.launch.tensor_parallel_size, "vllm-engine"
    elif isinstance(engine, HFEngineConfig):
        per_engine, kind = int(_is_cuda(engine.device)), "hf-engine"
    if gpus_per_engine is not None and kind:
        per_engine = gpus_per_engine
    if per_engine:
        wanted += [("rollout", f"{kind}-{i}", 0, per_engine) for i in range(engines)]
    return wanted


def plan_placement(
    config: RunConfig,
    source: str,
    count_gpus: Callable[[], int] = visible_gpus,
    environ: Mapping[str, str] = os.environ,
) -> Placement:
    """The run's placement (see the module docstring); ``count_gpus`` is asked only when neither ``run.gpus`` nor
    ``CUDA_VISIBLE_DEVICES`` in ``environ`` (``dart run``'s own) says how many GPUs there are.

    Raises:
        ConfigError: The plan needs more GPUs than the machine has, or ``run.gpus`` declares more than
            ``dart run`` was given (``source`` names the config).
    """
    given = _given_devices(source, environ)
    gpus = config.run.gpus if config.run.gpus is not None else len(given) if given is not None else count_gpus()
    if given is not None and gpus > len(given):
        raise ConfigError(
            source,
            "run.gpus",
            f"declares {gpus} GPUs but dart run was given {len(given)} ({VISIBLE_DEVICES}={environ[VISIBLE_DEVICES]})",
        )
    wanted = demand(config, has_gpus=gpus > 0)
    needed = sum(n for *_, n in wanted)
    # Sharing hands the GPUs out again, but a process never gets one GPU twice.
    shared = config.run.share_gpus and all(n <= gpus for *_, n in wanted)
    if needed > gpus and not shared:
        counted = "run.gpus" if config.run.gpus is not None else "torch.cuda.device_count(); declare run.gpus"
        how = (
            "run.share_gpus cannot help: one process alone needs more"
            if config.run.share_gpus
            else "or set run.share_gpus"
        )
        raise ConfigError(
            source,
            "run.gpus",
            f"the run needs {needed} GPUs ({_needs(wanted)}) but the machine has {gpus} ({counted}): "
            f"lower the trainer's ranks or the engines, run on a machine with more, {how}",
        )
    machine = given if given is not None else list(range(gpus))
    processes, first = [], 0
    for service, process, node, count in wanted:
        devices = tuple(machine[(first + i) % len(machine)] for i in range(count))
        processes.append(ProcessPlacement(service=service, process=process, node=node, devices=devices))
        first += count
    return Placement(gpus=gpus, processes=tuple(processes))


def placed(config: RunConfig, placement: Placement) -> RunConfig:
    """``config`` as its placed processes must read it: each launched vLLM server's GPUs in
    ``launch.devices``, and CUDA devices without an index (:func:`on_given_gpus`)."""
    config = on_given_gpus(config)
    engine = config.rollout.engine
    servers = placement.vllm_devices()
    if isinstance(engine, VLLMEngineConfig) and engine.launch is not None and servers:
        engine = engine.model_copy(update={"launch": engine.launch.model_copy(update={"devices": servers})})
        config = config.model_copy(update={"rollout": config.rollout.model_copy(update={"engine": engine})})
    return config


def on_given_gpus(config: RunConfig) -> RunConfig:
    """``config`` with the trainer's and hf engines' CUDA device ``cuda``: a process is given its GPUs
    (``CUDA_VISIBLE_DEVICES``), and an index would count within them, not among the machine's."""
    train, rollout = config.train, config.rollout
    if _is_cuda(train.device):
        train = train.model_copy(update={"device": "cuda"})
    engine = rollout.engine
    if isinstance(engine, HFEngineConfig) and _is_cuda(engine.device):
        engine = engine.model_copy(update={"device": "cuda"})
    return config.model_copy(update={"train": train, "rollout": rollout.model_copy(update={"engine": engine})})


def _given_devices(source: str, environ: Mapping[str, str]) -> list[int] | None:
    """The GPU indices in ``environ``'s ``CUDA_VISIBLE_DEVICES``; None when it is unset (every GPU).

    Raises:
        ConfigError: It names GPUs otherwise than by index (UUIDs, MIG instances).
    """
    value = environ.get(VISIBLE_DEVICES)
    if value is None:
        return None
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if not all(e.isdigit() for e in entries):
        raise ConfigError(
            source,
            "run.gpus",
            f"dart run was given {VISIBLE_DEVICES}={value}, which it cannot hand out by index: list GPU indices "
            "there, or unset it",
        )
    return [int(e) for e in entries]


def _node_rank(config: RunConfig) -> int:
    backend = config.train.backend
    return backend.node_rank if isinstance(backend, NodeSettings) else 0


def _server(process: ProcessPlacement) -> bool:
    return process.process.startswith("vllm-engine-")


def _is_cuda(device: str) -> bool:
    return device.split(":", 1)[0] == "cuda"


def _needs(wanted: list[Want]) -> str:
    """``trainer 2, 4 vllm engines x 1``: who needs the GPUs."""
    parts = []
    for kind in ("trainer", "vllm-engine-", "hf-engine-"):
        counts = [n for _, process, _, n in wanted if process.startswith(kind)]
        if not counts:
            continue
        if kind == "trainer":
            parts.append(f"trainer {counts[0]}")
        else:
            parts.append(f"{len(counts)} {kind.rstrip('-').replace('-', ' ')}s x {counts[0]}")
    return ", ".join(parts)
