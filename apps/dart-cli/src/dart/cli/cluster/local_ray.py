"""``--ray local``: a throwaway Ray cluster on this machine, for trials and tests.

A head and ``cluster.local.workers`` worker nodes, each a separate ``ray start --block`` process (its own
raylet, object store and ports), each declaring ``gpus_per_node`` logical GPUs: Ray hands them out as on real
hardware (``CUDA_VISIBLE_DEVICES`` per actor) without a GPU being there. Every node offers the custom resource
``dart_node_<name>`` (``head``, ``worker-1``, ...), which names it in the summary. Every process the cluster
starts is in its node's process group, or names the cluster's own temporary directory: :meth:`stop` ends them
all, and leaves no other Ray on the machine touched.

Ray binds the address it is given (``127.0.0.1`` here); run it inside a network namespace that has only
loopback to keep every port off the network (tests do: ``unshare -n``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dart.cli.cluster.config import LocalRaySection
from dart.cli.cluster.ray_cluster import ClusterError, Node
from dart.cli.cluster.ray_host import NODE_NAME_PREFIX
from dart.runtime.lifetime import die_with_parent
from dart.runtime.ports import free_ports

HOST = "127.0.0.1"
STARTED = b"Ray runtime started."
"""What ``ray start`` prints once its node registered with the cluster."""
START_ATTEMPTS = 3
"""Tries to start each node (see :meth:`LocalRayCluster.start`)."""
WORKER_PORTS = 100
"""Worker ports per node (a range of its own, so two nodes never hand out the same port)."""


class LocalRayCluster:
    """The cluster of ``settings``; :meth:`start` it, then :meth:`stop` it (idempotent)."""

    def __init__(self, settings: LocalRaySection) -> None:
        self.settings = settings
        self.names = ["head", *(f"worker-{i}" for i in range(1, settings.workers + 1))]
        self.pids: dict[str, int] = {}
        """Each node's ``ray start`` process (the leader of its process group)."""
        self._dir: Path | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self.address = ""
        self._worker_ports = 0

    @property
    def directory(self) -> Path | None:
        """The cluster's own temporary directory (its nodes' sessions and logs), once started."""
        return self._dir

    def declared(self) -> list[Node]:
        """The nodes as they will be (for the capacity check before anything starts)."""
        return [Node(f"declared-{n}", HOST, n, self._resources(n)) for n in self.names]

    def _resources(self, name: str) -> dict[str, float]:
        """Node ``name``'s declared resources."""
        s = self.settings
        extra = s.worker_resources if name != "head" else {}
        return {"CPU": s.cpus_per_node, "GPU": s.gpus_per_node, NODE_NAME_PREFIX + name: 1.0, **extra}

    def start(self) -> str:
        """Start the head, then the workers; the GCS address once the head accepts connections.

        Raises:
            ClusterError: A node's ``ray start`` exited, or the head did not answer within
                ``start_timeout_s`` (the error names the node's log).
        """
        self._dir = Path(tempfile.mkdtemp(prefix="dart-ray-"))
        gcs, client = free_ports(2, HOST)
        # Worker port ranges below the kernel's ephemeral range (where the other ports come from), one per node.
        self._worker_ports = random.randrange(10000, 32000 - WORKER_PORTS * len(self.names), WORKER_PORTS)
        self.address = f"{HOST}:{gcs}"
        deadline = time.monotonic() + self.settings.start_timeout_s
        # One node at a time, each once its ray start reports it started: a worker that joins while the head is still
        # starting times out (seen on a 2-core machine). ray start gives its raylet 30 s to register (fixed in
        # Ray): on a loaded machine that can pass, so a node that exits while starting is started again.
        for name in self.names:
            head = [
                "--head",
                f"--port={gcs}",
                f"--ray-client-server-port={client}",
                f"--temp-dir={self._dir / 'ray'}",
                "--include-dashboard=false",
            ]
            for attempt in range(1, START_ATTEMPTS + 1):
                log = self._dir / f"{name}.log"
                log_from = log.stat().st_size if log.is_file() else 0
                self._node(name, head if name == "head" else [f"--address={self.address}"])
                if self._came_up(name, log_from, deadline, last=attempt == START_ATTEMPTS):
                    break
        return self.address

    def wait_for_nodes(self, alive: int, count_alive: object) -> None:
        """Wait until ``count_alive()`` reaches ``alive`` (every node joined).

        Raises:
            ClusterError: A node exited, or they were not all there within ``start_timeout_s``.
        """
        assert callable(count_alive)
        deadline = time.monotonic() + self.settings.start_timeout_s
        while count_alive() < alive:
            self._check_alive(deadline)
            time.sleep(0.5)

    def stop(self) -> None:
        """End every process of the cluster (its nodes' groups, then any stray naming its directory)."""
        # A throwaway cluster keeps nothing worth a graceful stop: its nodes' groups are killed outright (a
        # SIGTERM'd ``ray start --block`` takes 15 s and more to end its node).
        for proc in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if self._dir is not None:
            _kill_naming(str(self._dir))
            shutil.rmtree(self._dir, ignore_errors=True)
        self._procs.clear()

    def _node(self, name: str, args: list[str]) -> None:
        """Start node ``name``."""
        assert self._dir is not None
        s = self.settings
        ports = free_ports(6, HOST)
        first = self._worker_ports + WORKER_PORTS * self.names.index(name)
        command = [
            *_ray_command(),
            "start",
            "--block",
            "--disable-usage-stats",
            f"--node-ip-address={HOST}",
            f"--num-cpus={s.cpus_per_node}",
            f"--num-gpus={s.gpus_per_node}",
            f"--resources={json.dumps({k: v for k, v in self._resources(name).items() if k not in ('CPU', 'GPU')})}",
            f"--object-store-memory={s.object_store_mib * 1024 * 1024}",
            f"--node-manager-port={ports[0]}",
            f"--object-manager-port={ports[1]}",
            f"--dashboard-agent-listen-port={ports[2]}",
            f"--dashboard-agent-grpc-port={ports[3]}",
            f"--metrics-export-port={ports[4]}",
            f"--runtime-env-agent-port={ports[5]}",
            f"--min-worker-port={first}",
            f"--max-worker-port={first + WORKER_PORTS - 1}",
            *args,
        ]
        out = open(self._dir / f"{name}.log", "ab")
        try:
            proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        finally:
            out.close()
        self._procs.append(proc)
        self.pids[name] = proc.pid

    def _came_up(self, name: str, log_from: int, deadline: float, last: bool) -> bool:
        """Wait for node ``name``'s ``ray start`` to report the node started (in its log after byte ``log_from``);
        False when it exited first and may be tried again (not ``last``), after which it is forgotten.

        Raises:
            ClusterError: It exited on its ``last`` try, another node exited, or the deadline passed.
        """
        assert self._dir is not None
        proc, log = self._procs[-1], self._dir / f"{name}.log"
        while STARTED not in log.read_bytes()[log_from:]:
            if proc.poll() is not None and not last:
                self._procs.pop()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                return False
            self._check_alive(deadline)
            time.sleep(0.2)
        return True

    def _check_alive(self, deadline: float) -> None:
        assert self._dir is not None
        for name, proc in zip(self.names, self._procs, strict=False):
            if proc.poll() is not None:
                tail = (self._dir / f"{name}.log").read_text(errors="replace").strip().splitlines()[-5:]
                raise ClusterError(f"ray start of node {name} exited {proc.returncode}: " + " | ".join(tail))
        if time.monotonic() > deadline:
            raise ClusterError(
                f"the local Ray cluster's nodes did not all come up within {self.settings.start_timeout_s:g} s "
                f"(cluster.local.start_timeout_s); logs in {self._dir}"
            )


def _ray_command() -> list[str]:
    """``ray`` of this Python environment."""
    script = Path(sys.executable).parent / "ray"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ray.scripts.scripts"]


def _kill_naming(text: str) -> None:
    """SIGKILL every process of this user whose command line contains ``text``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                os.kill(int(entry.name), signal.SIGKILL)
