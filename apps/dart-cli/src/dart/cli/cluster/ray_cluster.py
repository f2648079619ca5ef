"""A Ray cluster as ``dart run`` and ``dart doctor`` see it: connecting (with a clear error where none answers),
its nodes and their resources, and whether a run's asks fit before anything starts."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from dart.cli.cluster.ray_host import node_name
from dart.protocol.errors import ConfigError, DartError

INSTALL_HINT = "Ray is not installed here: pip install 'dart-cli[ray]' (in this workspace: uv sync --extra ray)"

CONNECT_TIMEOUT_S = 5.0
"""How long the GCS address may take to accept a connection before it counts as unreachable."""


class ClusterError(DartError):
    """The Ray cluster could not be started or used (a node that exited, a cluster that did not come up)."""


@dataclass(frozen=True)
class Node:
    """One alive node of the cluster."""

    node_id: str
    ip: str
    name: str
    """A ``--ray local`` node's name, else ``<ip>/<node id prefix>``."""
    resources: dict[str, float]
    """Its total resources (``CPU``, ``GPU``, ``memory``, custom ones)."""


@dataclass(frozen=True)
class Ask:
    """What one service asks of the cluster: one actor (one bundle) or, for the trainer, a bundle per node."""

    service: str
    bundles: list[dict[str, float]]
    strategy: str = "PACK"
    """How the bundles are placed (Ray's placement-group strategies; one bundle: where it fits)."""
    on_node: str | None = None
    """The node it is pinned to (``cluster.services.<service>.on_head``), by id."""
    processes: list[str] = field(default_factory=list)
    """Who needs its GPUs, for the error (``trainer 2 x 1``, ``2 hf engines x 1``)."""


def import_ray(source: str) -> ModuleType:
    """The ``ray`` module, or a config error saying how to install it."""
    # Started under ``uv run``, a Ray driver by default has every worker re-create the project's environment with
    # uv (from the package index). Each node already runs DART's installed environment, so that stays off unless
    # asked for. Ray reads the setting when it is imported.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    try:
        import ray
    except ImportError:
        raise ConfigError(source, "cluster.kind", f"is 'ray': {INSTALL_HINT}") from None
    return ray


def connect(address: str, source: str) -> ModuleType:
    """Join the cluster at ``address`` (``host:port`` of its GCS) as a driver; the ``ray`` module.

    Raises:
        ConfigError: Ray is not installed, or nothing accepts a connection at ``address`` (checked first:
            ``ray.init`` on a dead address retries for minutes).
    """
    ray = import_ray(source)
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError(source, "cluster.address", f"{address}: no Ray cluster answers there ({exc})") from None
    # log_to_driver off: dart run's stdout ends with the summary; the services log into the run directory.
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, namespace="dart")
    return ray


def alive_nodes(ray: ModuleType) -> list[Node]:
    """The cluster's alive nodes, the head first (by its name), then by name."""
    found = [
        Node(
            n["NodeID"],
            n["NodeManagerAddress"],
            node_name(n["NodeID"], n["NodeManagerAddress"], n["Resources"]),
            dict(n["Resources"]),
        )
        for n in ray.nodes()
        if n["Alive"]
    ]
    return sorted(found, key=lambda n: (n.name != "head", n.name))


def describe(nodes: Sequence[Node]) -> list[dict[str, Any]]:
    """The nodes as JSON-ready rows: name, ip, node id and the resources a run asks for (CPU, GPU, custom)."""
    return [
        {
            "name": n.name,
            "ip": n.ip,
            "node_id": n.node_id,
            "resources": {k: v for k, v in sorted(n.resources.items()) if _asked_kind(k)},
        }
        for n in nodes
    ]


def check_fits(asks: Sequence[Ask], nodes: Sequence[Node], source: str, where: str) -> None:
    """Refuse a run whose asks cannot all be placed on ``nodes`` (``where`` names the cluster in the error).

    Checked: the GPUs of every ask together against the cluster's; every resource asked is offered by some node;
    every bundle fits some node (the one it is pinned to, where it is); a ``STRICT_SPREAD`` trainer finds as many
    distinct nodes as it has bundles. Ray's own scheduler decides the rest (a cluster busy with other jobs
    makes a service wait, up to ``cluster.placement_timeout_s``).

    Raises:
        ConfigError: Naming the asking service, what it asks and what the cluster has.
    """
    gpus = sum(n.resources.get("GPU", 0.0) for n in nodes)
    needed = sum(b.get("GPU", 0.0) for a in asks for b in a.bundles)
    if needed > gpus:
        who = ", ".join(p for a in asks for p in a.processes)
        raise ConfigError(
            source,
            "cluster.gpus",
            f"the run needs {needed:g} GPUs ({who}) but {where} has {gpus:g}: lower the trainer's ranks or the "
            "engines, or add nodes",
        )
    offered = {k for n in nodes for k in n.resources}
    for ask in asks:
        for bundle in ask.bundles:
            missing = sorted(k for k, v in bundle.items() if v > 0 and k not in offered)
            if missing:
                raise ConfigError(
                    source,
                    f"cluster.services.{ask.service}",
                    f"asks for {missing[0]!r}, which no node of {where} offers (they offer {sorted(_public(offered))})",
                )
            candidates = [n for n in nodes if ask.on_node is None or n.node_id == ask.on_node]
            if not any(_fits(bundle, n) for n in candidates):
                pinned = " on the node dart run runs on" if ask.on_node is not None else ""
                raise ConfigError(
                    source,
                    f"cluster.services.{ask.service}",
                    f"asks for {_show(bundle)}{pinned}, which no node of {where} has "
                    f"(nodes: {'; '.join(f'{n.name} {_show(n.resources)}' for n in candidates)})",
                )
        if ask.strategy == "STRICT_SPREAD":
            hosts = [n for n in nodes if all(_fits(b, n) for b in ask.bundles[:1])]
            if len(hosts) < len(ask.bundles):
                raise ConfigError(
                    source,
                    "cluster.trainer_strategy",
                    f"is STRICT_SPREAD: the trainer's {len(ask.bundles)} nodes need as many nodes of {where} with "
                    f"{_show(ask.bundles[0])}, and {len(hosts)} have it",
                )


def _fits(bundle: dict[str, float], node: Node) -> bool:
    return all(node.resources.get(k, 0.0) >= v for k, v in bundle.items())


def _asked_kind(key: str) -> bool:
    return key in ("CPU", "GPU") or not (
        key in ("memory", "object_store_memory") or key.startswith("node:") or key.startswith("accelerator_type")
    )


def _public(keys: set[str]) -> list[str]:
    return [k for k in keys if _asked_kind(k)]


def _show(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items()) if _asked_kind(k)) + "}"
