"""Processes the VM server starts for an episode, each in its own session, so a revert can kill them all.

Every command runs with ``start_new_session=True``: its process id is its session id, and any
child it forks (a shell's job, an app's helper, a double-forked daemon) keeps that session unless
it calls ``setsid`` itself. Every command also carries the environment variable
:data:`MARKER_VAR` (the desktop's HOME), which children inherit even across ``setsid``.
:meth:`ProcessTracker.kill_all` signals each tracked process group and, by scanning ``/proc``,
every process still in a tracked session or carrying the marker; :func:`kill_marked` does the
marker sweep alone (the desktop's owner uses it after the server is gone).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dart.env.desktop.sandbox import DesktopUser

MARKER_VAR = "DART_DESKTOP_HOME"
"""Environment variable set on every command the server starts: the desktop's HOME."""


def marked_processes(value: str) -> list[int]:
    """Pids of live processes (other than this one) whose environment has ``MARKER_VAR=value``."""
    marker = f"{MARKER_VAR}={value}".encode()
    found: list[int] = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_marked(value: str, grace_s: float = 1.0) -> int:
    """Kill every process carrying ``MARKER_VAR=value`` (TERM, then KILL); returns how many were found."""
    pids = marked_processes(value)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGTERM and pids:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and marked_processes(value):
                time.sleep(0.02)
            pids = marked_processes(value)
    return len(pids)


def _sessions_members(sessions: set[int]) -> list[int]:
    """Pids of live processes whose session id is in ``sessions`` (Linux ``/proc``)."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the ")" that closes the command name: state ppid pgrp session ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and int(fields[3]) in sessions and fields[0] != "Z":
            found.append(int(entry.name))
    return found


class ProcessTracker:
    """Starts commands for the desktop and remembers them until :meth:`kill_all`.

    Args:
        env: Environment of every command (``DISPLAY``, ``HOME`` ...); :data:`MARKER_VAR` is added
            (set to ``cwd``) unless present.
        cwd: Working directory of every command.
        user: Account every command runs as; None: this process's.
    """

    def __init__(self, env: Mapping[str, str], cwd: Path, user: DesktopUser | None = None) -> None:
        self.env = dict(env)
        self._as_user: dict[str, Any] = user.popen_kwargs() if user is not None else {}
        self.marker = self.env.setdefault(MARKER_VAR, str(cwd))
        self.cwd = cwd
        self._lock = threading.Lock()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    def _track(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            # Reap finished ones so the table does not grow over a long episode.
            for pid in [p for p, pr in self._procs.items() if pr.poll() is not None and p != proc.pid]:
                del self._procs[pid]
            self._procs[proc.pid] = proc

    def launch(self, command: str | Sequence[str], *, shell: bool, cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``command`` detached (output discarded) and track it.

        Raises:
            OSError: The executable is missing or cannot run.
        """
        proc = subprocess.Popen(
            command,
            shell=shell,
            env=self.env,
            cwd=cwd or self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            **self._as_user,
        )
        self._track(proc)
        return proc

    def run(
        self,
        command: str | Sequence[str],
        *,
        shell: bool,
        timeout: float,
        cwd: Path | None = None,
        merge_stderr: bool = False,
    ) -> tuple[int, str, str]:
        """Run ``command`` to completion: ``(returncode, stdout, stderr)`` as text.

        On timeout its whole session is killed and ``subprocess.TimeoutExpired`` raised.
        """
        proc = subprocess.Popen(
            command,
            shell=shell,
            env=self.env,
            cwd=cwd or self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            start_new_session=True,
            **self._as_user,
        )
        self._track(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_sessions({proc.pid})
            proc.communicate()
            raise
        text = out.decode(errors="replace") if out else ""
        etext = err.decode(errors="replace") if err else ""
        return proc.returncode, text, etext

    def kill_all(self, grace_s: float = 1.0) -> int:
        """Kill every tracked process and its session (TERM, then KILL after ``grace_s``).

        Returns:
            How many tracked commands were still running.
        """
        with self._lock:
            procs = list(self._procs.values())
            self._procs.clear()
        running = sum(1 for p in procs if p.poll() is None)
        self._kill_sessions({p.pid for p in procs}, grace_s)
        # Whatever left its session (setsid, daemons) still carries the marker.
        kill_marked(self.marker, grace_s)
        for p in procs:
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        return running

    @staticmethod
    def _kill_sessions(sessions: set[int], grace_s: float = 1.0) -> None:
        if not sessions:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for sid in sessions:
                try:
                    os.killpg(sid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            for pid in _sessions_members(sessions):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            if sig == signal.SIGTERM:
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline and _sessions_members(sessions):
                    time.sleep(0.02)
