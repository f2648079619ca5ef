"""Starting and stopping a run's service processes: the seam between ``dart run``'s supervisor and where the
services run.

A :class:`Launcher` starts ``dart serve <service>`` and returns a :class:`ServiceProcess`, a handle shaped like
:class:`subprocess.Popen` (``poll``, ``wait``, ``send_signal``, ``kill``), which the supervisor watches and
restarts and :func:`stop_process` stops. :class:`LocalLauncher` runs them as ``dart run``'s children with the
GPUs of the run's placement; ``dart.cli.cluster.ray_launch.RayLauncher`` runs them as Ray actors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from dart.cli.cluster.commands import serve_argv
from dart.cli.stack.config import ServiceName
from dart.cli.stack.placement import Placement, ProcessPlacement
from dart.runtime.lifetime import die_with_parent
from dart.runtime.stacks import DUMP_SIGNAL

log = logging.getLogger(__name__)

STACK_DUMP_S = 2.0
"""How long a process that did not stop has to write its stacks before it is killed."""


class ServiceProcess(Protocol):
    """A running service, as the supervisor sees it (:class:`subprocess.Popen` is one)."""

    pid: int
    returncode: Any
    args: Any

    def poll(self) -> int | None:
        """The exit code once it ended; None while it runs."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; the exit code. Raises :class:`subprocess.TimeoutExpired` past ``timeout``."""

    def send_signal(self, sig: int) -> None:
        """Signal the service's process."""

    def kill(self) -> None:
        """End it at once (its process group with it, where the handle is not a plain :class:`Popen`)."""


class Launcher(Protocol):
    """Where a run's services are started."""

    def start(self, service: ServiceName, env: Mapping[str, str]) -> ServiceProcess:
        """Start ``dart serve <service>`` with ``env`` added to its environment."""

    def placement(self) -> list[ProcessPlacement]:
        """The GPUs each placed process was given (the summary's ``placement``)."""

    def close(self) -> None:
        """Release what the launcher holds (after every service stopped)."""


class LocalLauncher:
    """Services as children of ``dart run``, each on its GPUs of ``placement``."""

    def __init__(self, config_file: Path, run_dir: Path, placement: Placement) -> None:
        self._config_file = config_file
        self._run_dir = run_dir
        self._placement = placement

    def start(self, service: ServiceName, env: Mapping[str, str]) -> ServiceProcess:
        return spawn(service, self._config_file, self._run_dir, {**env, **self._placement.service_environment(service)})

    def placement(self) -> list[ProcessPlacement]:
        return list(self._placement.processes)

    def close(self) -> None:
        return None


def spawn(
    service: str, config_file: Path, run_dir: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``dart serve <service>`` as a child process logging to ``logs/<service>.log``.

    ``env`` adds to the inherited environment (e.g. the service's NATS user and password file).
    """
    log_dir = run_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    out = open(log_dir / f"{service}.log", "ab")  # the child owns it; closed here after Popen
    try:
        return subprocess.Popen(
            serve_argv(service, str(config_file)),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env} if env else None,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
    finally:
        out.close()


def stop_process(proc: ServiceProcess, timeout_s: float) -> int:
    """SIGTERM, wait, then kill; returns the exit code.

    One that does not stop in time is first asked for its stacks (:data:`DUMP_SIGNAL`: a ``dart serve``
    process writes where each thread and task waits to the end of its log), then killed with its group.
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(DUMP_SIGNAL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STACK_DUMP_S)
            log.warning("%s did not stop within %.0f s: killed (its stacks end its log)", _named(proc), timeout_s)
            kill_group(proc)
            proc.wait()
    return int(proc.returncode)


def kill_group(proc: ServiceProcess) -> None:
    """Kill ``proc`` and everything in its process group (a child of ``dart run`` leads its own session)."""
    if not isinstance(proc, subprocess.Popen):
        proc.kill()
        return
    # Its group may be gone already: it can end while writing its stacks.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _named(proc: ServiceProcess) -> str:
    args = proc.args if isinstance(proc.args, list | tuple) else [proc.args]
    return f"{' '.join(str(a) for a in args[-4:])} (pid {proc.pid})"
