"""``dart run``'s services as actors on a Ray cluster (see :mod:`dart.cli.cluster`).

Per service, one :class:`~dart.cli.cluster.ray_host.ProcessHost` actor holding what the service asks
(:func:`asks`: ``cluster.services.<service>`` CPUs and custom resources, and the GPUs its processes need, from
``dart.cli.stack.placement.demand``); the actor runs ``dart serve <service>`` on its node. The trainer is a
placement group of one bundle per node its ranks span (``cluster.trainer_strategy``): an actor per bundle runs
that node's ranks under torchrun, node ``i`` as ``train.backend.node_rank`` ``i``, all meeting at a rendezvous
on node 0's address. Each start is placed anew, so a restarted service lands wherever Ray finds room (another
node when its own is gone). The handles are shaped like :class:`subprocess.Popen` for the supervisor.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from dart.cli.cluster.config import LOCAL_ADDRESS, ServiceResources
from dart.cli.cluster.launch import ServiceProcess
from dart.cli.cluster.local_ray import LocalRayCluster
from dart.cli.cluster.ray_cluster import Ask, Node, alive_nodes, check_fits, connect, import_ray
from dart.cli.cluster.ray_host import ProcessHost
from dart.cli.stack.config import SERVICES, RunConfig, ServiceName
from dart.cli.stack.placement import ProcessPlacement, Want, demand

log = logging.getLogger(__name__)

LOST_EXIT_CODE = -9
"""The exit code of a service whose actor or node is gone (reported as killed)."""

TRAIN_NODE_RANK = "DART_TRAIN__BACKEND__NODE_RANK"
TRAIN_RDZV_ENDPOINT = "DART_TRAIN__BACKEND__RDZV_ENDPOINT"


def wants(config: RunConfig, has_gpus: bool) -> list[Want]:
    """The GPUs each process of a Ray run needs (every trainer node; ``cluster.gpus`` where set)."""
    gpus = config.cluster.gpus
    return demand(
        config,
        has_gpus=has_gpus,
        every_node=True,
        gpus_per_rank=gpus.per_trainer_rank,
        gpus_per_engine=gpus.per_engine,
    )


def asks(config: RunConfig, has_gpus: bool, head: str) -> list[Ask]:
    """What each service asks of the cluster (``head``: the id of the node ``dart run`` runs on)."""
    needed = wants(config, has_gpus)
    out = []
    for service in SERVICES:
        res = _resources(config, service)
        mine = [w for w in needed if w[0] == service]
        if service == "train":
            nnodes = getattr(config.train.backend, "nnodes", 1)
            per_node = {node: n for _, _, node, n in mine}
            bundles = [_bundle(res, per_node.get(i, 0)) for i in range(nnodes)]
            strategy = config.cluster.trainer_strategy
        else:
            bundles, strategy = [_bundle(res, sum(n for *_, n in mine))], "PACK"
        who = [f"{p} {n}" for _, p, _, n in mine]
        out.append(Ask(service, bundles, strategy, head if res.on_head else None, who))
    return out


class RaySession:
    """A connected cluster for one run: its nodes, and launchers for its services."""

    def __init__(self, ray: ModuleType, address: str, nodes: list[Node], local: LocalRayCluster | None) -> None:
        self.ray = ray
        self.address = address
        self.nodes = nodes
        self.local = local
        # The node dart run runs on; in a local cluster every node shares this machine, so the one named head.
        here = str(ray.get_runtime_context().get_node_id())
        self.head = next((n.node_id for n in nodes if n.name == "head"), here) if local is not None else here
        self.has_gpus = any(n.resources.get("GPU", 0.0) > 0 for n in nodes)

    @property
    def service_host(self) -> str:
        """Where the run's embedded servers listen: loopback for a local cluster, else this node's address."""
        return "127.0.0.1" if self.local is not None else str(self.ray.util.get_node_ip_address())

    def summary(self) -> dict[str, Any]:
        """The summary's ``cluster``: kind, address and nodes (name, resources)."""
        return {
            "kind": "ray",
            "address": LOCAL_ADDRESS if self.local is not None else self.address,
            "nodes": [
                {"name": n.name, "gpus": n.resources.get("GPU", 0.0), "cpus": n.resources.get("CPU", 0.0)}
                for n in self.nodes
            ],
        }

    def launcher(self, config: RunConfig, config_file: Path) -> RayLauncher:
        return RayLauncher(self, config, config_file)


@contextlib.contextmanager
def ray_session(config: RunConfig, source: str) -> Iterator[RaySession]:
    """Connect to ``cluster.address`` (or start the ``local`` cluster) and check that the run fits; disconnect
    (and stop a local cluster) on the way out.

    Raises:
        ConfigError: Ray is not installed, the address does not answer, or the run asks for more than the
            cluster has (before anything is started or written).
        ClusterError: The local cluster did not come up.
    """
    address = config.cluster.address
    import_ray(source)
    local = LocalRayCluster(config.cluster.local) if address == LOCAL_ADDRESS else None
    ray: ModuleType | None = None
    try:
        if local is not None:
            declared = local.declared()
            has_gpus = any(n.resources["GPU"] for n in declared)
            check_fits(asks(config, has_gpus, declared[0].node_id), declared, source, "the local cluster")
            address = local.start()
        ray = connect(address, source)
        if local is not None:
            connected = ray
            local.wait_for_nodes(len(local.names), lambda: len(alive_nodes(connected)))
        session = RaySession(ray, address, alive_nodes(ray), local)
        where = "the local cluster" if local is not None else f"the Ray cluster at {address}"
        check_fits(asks(config, session.has_gpus, session.head), session.nodes, source, where)
        yield session
    finally:
        if ray is not None:
            ray.shutdown()
        if local is not None:
            local.stop()


class RayLauncher:
    """Starts each service as an actor (the trainer as a placement group); see the module docstring."""

    def __init__(self, session: RaySession, config: RunConfig, config_file: Path) -> None:
        self._session = session
        self._ray = session.ray
        self._config = config
        self._config_file = config_file
        self._host = self._ray.remote(ProcessHost)
        self._wants = wants(config, session.has_gpus)
        self._asks = {a.service: a for a in asks(config, session.has_gpus, session.head)}
        self._starts: Counter[str] = Counter()
        self._placements: list[ProcessPlacement] = []
        self._groups: list[Any] = []

    def start(self, service: ServiceName, env: Mapping[str, str]) -> ServiceProcess:
        self._starts[service] += 1
        attempt = self._starts[service]
        try:
            if service == "train":
                return self._start_trainer(dict(env), attempt)
            return self._start_one(service, dict(env), attempt)
        except Exception as exc:  # no room in time, the run directory not on the node, a node lost meanwhile
            reason = f"dart run: start {attempt} of {service} on the Ray cluster failed: {exc}"
            log.warning("%s", reason)
            with contextlib.suppress(OSError), open(self._log(service), "a") as out:
                out.write(reason + "\n")
            return Unstarted(service, reason)

    def placement(self) -> list[ProcessPlacement]:
        return list(self._placements)

    def close(self) -> None:
        for group in self._groups:
            with contextlib.suppress(Exception):
                self._ray.util.remove_placement_group(group)
        self._groups.clear()

    def _start_one(self, service: ServiceName, env: dict[str, str], attempt: int) -> ServiceProcess:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ask = self._asks[service]
        strategy = NodeAffinitySchedulingStrategy(ask.on_node, soft=False) if ask.on_node is not None else None
        actor = self._host.options(**_actor_options(ask.bundles[0]), scheduling_strategy=strategy).remote()
        where = self._placed(actor)
        mine = [w for w in self._wants if w[0] == service]
        placed = self._record(mine, where, attempt)
        servers = [list(p.devices) for p in placed if p.process.startswith("vllm-engine-")]
        return self._run(actor, service, env, servers, where)

    def _start_trainer(self, env: dict[str, str], attempt: int) -> ServiceProcess:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ask = self._asks["train"]
        group = placement_group(
            ask.bundles, strategy=ask.strategy, name=f"dart-{self._config.run.name}-train-{attempt}"
        )
        self._groups.append(group)
        try:
            self._ray.get(group.ready(), timeout=self._config.cluster.placement_timeout_s)
        except Exception:
            self._release(group)
            raise
        actors = [
            self._host.options(
                **_actor_options(bundle),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            ).remote()
            for i, bundle in enumerate(ask.bundles)
        ]
        wheres = [self._placed(a) for a in actors]
        if len(actors) > 1:
            port = self._ray.get(actors[0].free_port.remote(wheres[0]["ip"]))
            env = {**env, TRAIN_RDZV_ENDPOINT: f"{wheres[0]['ip']}:{port}"}
        members = []
        for node, (actor, where) in enumerate(zip(actors, wheres, strict=True)):
            self._record([w for w in self._wants if w[0] == "train" and w[2] == node], where, attempt)
            members.append(self._run(actor, "train", {**env, TRAIN_NODE_RANK: str(node)}, [], where))
        return RayGroup(members, lambda: self._release(group))

    def _placed(self, actor: Any) -> dict[str, Any]:
        """Where ``actor`` landed, once Ray placed it (within ``cluster.placement_timeout_s``)."""
        try:
            return dict(self._ray.get(actor.where.remote(), timeout=self._config.cluster.placement_timeout_s))
        except Exception:
            self._ray.kill(actor, no_restart=True)
            raise

    def _run(
        self, actor: Any, service: str, env: dict[str, str], servers: list[list[int]], where: dict[str, Any]
    ) -> RayProcess:
        text = self._config_file.read_text()
        pid = self._ray.get(actor.start.remote(service, env, text, str(self._log(service)), servers))
        name = f"{service} on {where['host']}"
        return RayProcess(self._ray, actor, int(pid), name, self._config.cluster.poll_timeout_s)

    def _record(self, mine: list[Want], where: dict[str, Any], attempt: int) -> list[ProcessPlacement]:
        gpus, first, placed = list(where["gpus"]), 0, []
        for service, process, node, count in mine:
            devices = tuple(gpus[first : first + count])
            first += count
            placed.append(
                ProcessPlacement(
                    service=service, process=process, node=node, devices=devices, host=where["host"], attempt=attempt
                )
            )
        self._placements += placed
        return placed

    def _release(self, group: Any) -> None:
        if group in self._groups:
            self._groups.remove(group)
            with contextlib.suppress(Exception):
                self._ray.util.remove_placement_group(group)

    def _log(self, service: str) -> Path:
        run_dir = self._config.run.run_dir
        assert run_dir is not None
        return run_dir / "logs" / f"{service}.log"


class RayProcess:
    """One service actor's process, as the supervisor sees it."""

    def __init__(self, ray: ModuleType, actor: Any, pid: int, name: str, timeout_s: float) -> None:
        self._ray = ray
        self._actor = actor
        self._timeout_s = timeout_s
        self.pid = pid
        self.returncode: int | None = None
        self.args = [name]

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            code = self._ray.get(self._actor.poll.remote(), timeout=self._timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            return None  # a busy node, or one Ray has not yet declared dead: not taken for dead here
        except self._ray.exceptions.RayError:
            code = LOST_EXIT_CODE
        if code is not None:
            self._end(int(code))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return _wait(self, timeout)

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(self._ray.exceptions.RayError):
            self._ray.get(self._actor.signal.remote(int(sig)), timeout=self._timeout_s)

    def kill(self) -> None:
        if self.returncode is None:
            self._end(LOST_EXIT_CODE)

    def _end(self, code: int) -> None:
        """Record the exit, and end the actor (its process group first, where the node still answers)."""
        self.returncode = code
        with contextlib.suppress(self._ray.exceptions.RayError):
            self._ray.get(self._actor.kill.remote(), timeout=self._timeout_s)
        with contextlib.suppress(Exception):
            self._ray.kill(self._actor, no_restart=True)


class RayGroup:
    """The trainer's per-node processes as one service: it ends when all have ended, and fails (the others killed)
    as soon as one fails."""

    def __init__(self, members: list[RayProcess], release: Callable[[], None]) -> None:
        self._members = members
        self._release = release
        self.pid = members[0].pid
        self.returncode: int | None = None
        self.args = [m.args[0] for m in members]

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        codes = [m.poll() for m in self._members]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for member in self._members:
                member.kill()
            self._end(failed[0])
        elif all(c is not None for c in codes):
            self._end(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return _wait(self, timeout)

    def send_signal(self, sig: int) -> None:
        for member in self._members:
            member.send_signal(sig)

    def kill(self) -> None:
        for member in self._members:
            member.kill()
        if self.returncode is None:
            self._end(LOST_EXIT_CODE)

    def _end(self, code: int) -> None:
        self.returncode = code
        self._release()


@dataclass
class Unstarted:
    """A start that failed (no room within ``cluster.placement_timeout_s``, the run directory missing on the
    node): a process that exited 1 at once, so the supervisor restarts it with backoff, up to its limit."""

    service: str
    reason: str
    pid: int = 0
    returncode: int = 1
    args: Any = None

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        return None

    def kill(self) -> None:
        return None


def _wait(proc: RayProcess | RayGroup, timeout: float | None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    while (code := proc.poll()) is None:
        if deadline is not None and time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout or 0.0)
        time.sleep(0.2)
    return code


def _resources(config: RunConfig, service: ServiceName) -> ServiceResources:
    return getattr(config.cluster.services, service)  # type: ignore[no-any-return]


def _bundle(res: ServiceResources, gpus: int) -> dict[str, float]:
    """A bundle of ``res`` and ``gpus`` (zero entries left out; Ray refuses an empty bundle, so it asks a sliver
    of a CPU at least)."""
    bundle = {"CPU": res.cpus, "GPU": float(gpus), **res.resources}
    bundle = {k: v for k, v in bundle.items() if v > 0}
    return bundle or {"CPU": 0.01}


def _actor_options(bundle: dict[str, float]) -> dict[str, Any]:
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return {
        "num_cpus": bundle.get("CPU", 0.0),
        "num_gpus": bundle.get("GPU", 0.0),
        "resources": custom,
        "max_restarts": 0,  # dart run's supervisor restarts services, placing them anew
    }
