"""The run config's ``cluster`` section: where ``dart run`` starts its services."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dart.protocol.config import ConfigModel

LOCAL_ADDRESS = "local"
"""``cluster.address`` (and ``--ray local``) for a throwaway cluster on this machine."""


class ServiceResources(ConfigModel):
    """What one service's Ray actor asks of the node it lands on (beyond the GPUs its processes need)."""

    cpus: float = Field(default=1.0, ge=0)
    """Logical CPUs (per node of the trainer)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources, e.g. ``{desktop: 1}`` so an env service lands where its desktops are installed."""
    on_head: bool = False
    """Pin the service to the node ``dart run`` runs on (the data manager's index lives in the run directory)."""


def _on_head() -> ServiceResources:
    return ServiceResources(on_head=True)


class ClusterServices(ConfigModel):
    """Each service's ask (see :class:`ServiceResources`)."""

    env: ServiceResources = Field(default_factory=ServiceResources)
    data: ServiceResources = Field(default_factory=_on_head)
    rollout: ServiceResources = Field(default_factory=ServiceResources)
    train: ServiceResources = Field(default_factory=ServiceResources)


class ClusterGpus(ConfigModel):
    """GPUs asked per process, where the devices should not decide (None: they do; see
    ``dart.cli.stack.placement.demand``)."""

    per_trainer_rank: int | None = Field(default=None, ge=0)
    """GPUs per trainer rank; None: 1 when ``train.device`` is CUDA, else 0."""
    per_engine: int | None = Field(default=None, ge=0)
    """GPUs per engine; None: a launched vLLM server's ``launch.tensor_parallel_size``, 1 for an hf engine on
    CUDA, else 0."""


class LocalRaySection(ConfigModel):
    """The throwaway cluster of ``cluster.address: local`` (``--ray local``): a head and ``workers`` worker nodes,
    separate ``ray start`` processes on this machine, with declared (logical) GPUs."""

    workers: int = Field(default=2, ge=0)
    """Worker nodes beside the head."""
    gpus_per_node: int = Field(default=2, ge=0)
    """Logical GPUs each node declares (the head too): Ray hands them out as on real hardware."""
    cpus_per_node: int = Field(default=4, ge=1)
    """Logical CPUs each node declares."""
    worker_resources: dict[str, float] = Field(default_factory=dict)
    """Custom resources the worker nodes offer (not the head), e.g. ``{trainer_slot: 2}`` with the trainer asking
    ``{trainer_slot: 1}`` per node, as GPU machines set aside for training would."""
    object_store_mib: int = Field(default=100, ge=80)
    """Each node's object store (DART passes no data through Ray: the least Ray accepts is plenty)."""
    start_timeout_s: float = Field(default=120.0, gt=0)
    """How long the nodes may take to join."""


class ClusterSection(ConfigModel):
    """Where ``dart run`` starts its services: as its own child processes (``kind: local``), or as actors on a Ray
    cluster (``kind: ray``; ``dart run CONFIG --ray ADDRESS`` sets both).

    On Ray, each service is an actor that runs ``dart serve <service>`` on its node with the GPUs Ray gave it
    (``CUDA_VISIBLE_DEVICES``); the trainer is a placement group of one bundle per node its ranks span
    (``train.backend.nnodes``), whose ranks meet at a rendezvous on node 0. ``dart run`` stays the supervisor:
    restarts (a restarted service is placed anew, on another node when its own died), held-out validation,
    the summary. The run directory must be at the same path on every node (a shared filesystem): the policy,
    checkpoints, logs and telemetry live there.
    """

    kind: Literal["local", "ray"] = "local"
    address: str = LOCAL_ADDRESS
    """The Ray cluster's GCS address (``host:port``, as ``ray start --head`` prints it), or ``local`` for a
    throwaway cluster on this machine (``local``), stopped after the run."""
    local: LocalRaySection = Field(default_factory=LocalRaySection)
    services: ClusterServices = Field(default_factory=ClusterServices)
    gpus: ClusterGpus = Field(default_factory=ClusterGpus)
    trainer_strategy: Literal["SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"] = "SPREAD"
    """How the trainer's per-node bundles are placed (Ray's placement-group strategies). ``SPREAD`` puts them on
    different nodes where it can and still places a restarted trainer when a node is gone; ``STRICT_SPREAD``
    refuses to share a node."""
    placement_timeout_s: float = Field(default=300.0, gt=0)
    """How long a service may wait for Ray to find it room; past it the start counts as a death (restarted
    with backoff up to ``run.max_restarts``)."""
    poll_timeout_s: float = Field(default=10.0, gt=0)
    """How long a liveness check of a service's actor may take; one that does not answer is not taken for dead
    until Ray says its node or actor is (node death is Ray's health check's call)."""

    @model_validator(mode="after")
    def _address_is_local_or_host_port(self) -> ClusterSection:
        if self.address != LOCAL_ADDRESS:
            host, _, port = self.address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"address {self.address!r} is neither 'local' nor host:port (the GCS address)")
        return self
