"""The actor that runs one service process on a Ray node: ``dart serve <service>`` (or this node's share of the
trainer's ranks) with the GPUs Ray gave the actor.

It writes the run config it is handed into a directory of its own (with the node's vLLM server GPUs filled in),
starts the service in its own session, and answers the launcher's polls and signals. Its children do not
outlive it: the service's process group is killed when the actor's process ends, however it ends (a killed
node takes its services with it, as a real machine's loss does).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from dart.cli.cluster.commands import serve_argv
from dart.runtime.lifetime import die_with_parent, reap_group_with_this_process, release_group
from dart.runtime.ports import free_port

NODE_NAME_PREFIX = "dart_node_"
"""A custom resource ``dart_node_<name>`` names a node (``--ray local`` gives each of its nodes one)."""


def node_name(node_id: str, ip: str, resources: dict[str, float]) -> str:
    """A node's name in the summary: its ``dart_node_<name>`` resource's name, else ``<ip>/<node id prefix>``."""
    named = sorted(k[len(NODE_NAME_PREFIX) :] for k in resources if k.startswith(NODE_NAME_PREFIX))
    return named[0] if named else f"{ip}/{node_id[:8]}"


class ProcessHost:
    """One service process on the node Ray placed this actor on (used as ``ray.remote(ProcessHost)``)."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="dart-ray-host-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def where(self) -> dict[str, Any]:
        """This node: ``node_id``, ``ip``, ``host`` (its name) and ``gpus`` (the GPU indices Ray gave the actor)."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        nodes = ray.nodes()  # type: ignore[no-untyped-call]
        resources: dict[str, float] = next((n["Resources"] for n in nodes if n["NodeID"] == node_id), {})
        gpus = [int(g) for g in ray.get_gpu_ids()]
        return {"node_id": node_id, "ip": ip, "host": node_name(node_id, ip, resources), "gpus": gpus}

    def free_port(self, host: str) -> int:
        """A TCP port free on this node's ``host`` address (the trainer's rendezvous)."""
        return free_port(host)

    def start(
        self, service: str, env: dict[str, str], config_text: str, log_path: str, vllm_devices: list[list[int]]
    ) -> int:
        """Start ``dart serve <service>`` on ``config_text`` (with ``vllm_devices``, each launched vLLM server's GPUs
        on this node, filled in) and ``env`` over the actor's environment, its output appended to ``log_path``;
        returns its pid.

        Raises:
            RuntimeError: The run directory (``log_path``'s) is not on this node.
        """
        log_dir = Path(log_path).parent
        if not log_dir.is_dir():
            raise RuntimeError(
                f"the run directory's {log_dir} is not on node {self.where()['host']}: dart run on a Ray cluster "
                "needs the run directory at the same path on every node (a shared filesystem)"
            )
        config = self._dir / "config.yaml"
        config.write_text(_with_vllm_devices(config_text, vllm_devices))
        with open(log_path, "ab") as out:
            self._proc = subprocess.Popen(
                serve_argv(service, str(config)),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        reap_group_with_this_process(self._proc.pid)
        return self._proc.pid

    def poll(self) -> int | None:
        """The service's exit code once it ended; None while it runs."""
        return None if self._proc is None else self._proc.poll()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the service's process."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signum)

    def kill(self) -> int | None:
        """Kill the service's whole process group; its exit code."""
        if self._proc is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        code = self._proc.wait()
        release_group(self._proc.pid)
        shutil.rmtree(self._dir, ignore_errors=True)
        return code


def _with_vllm_devices(config_text: str, vllm_devices: list[list[int]]) -> str:
    """``config_text`` with ``rollout.engine.launch.devices`` set to ``vllm_devices`` (unchanged when empty)."""
    if not vllm_devices:
        return config_text
    data = yaml.safe_load(config_text)
    data["rollout"]["engine"]["launch"]["devices"] = vllm_devices
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False)
