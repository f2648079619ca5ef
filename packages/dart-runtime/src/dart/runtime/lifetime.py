"""Child processes that do not outlive their parent.

Every long-lived child DART starts (embedded servers, ``dart serve`` processes under ``dart run``,
vLLM servers, torchrun trainers) runs in its own session so it can be stopped as a group. A clean
shutdown stops them explicitly; this module covers the unclean one: when the parent is killed with
SIGKILL (or a test runner's hard timeout), no ``finally`` or ``atexit`` runs, and children would be
adopted by init and live on. On Linux the kernel can signal a child when its parent dies
(``PR_SET_PDEATHSIG``); :func:`die_with_parent` arms that between fork and exec.

Usage::

    subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent())

Caveat (documented by prctl(2)): the signal fires when the *thread* that forked the child exits.
Start children from a thread that lives as long as they should (the main thread, or the asyncio
loop's thread), not from a short-lived worker thread.

A child that is a launcher of others (chromedriver starting Chromium) takes its descendants with it only
if someone kills its whole group. :func:`reap_group_with_this_process` hands a process group to a
sidecar (started once per process, in its own session) that holds the read end of a pipe: when this
process ends, however (SIGKILL included), the kernel closes the write end, and the sidecar kills every
group still registered. :func:`release_group` unregisters a group this process stopped itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def exit_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; elsewhere a no-op).

    For a process started by someone else's launcher (a torchrun rank): it arms itself.
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def stop_signals_end_startup() -> None:
    """Until a service's event loop takes SIGTERM and SIGINT over, either ends this process with exit code 0.

    A ``dart serve`` process asked to stop while it is still importing and reading its config holds
    nothing to hand back, so leaving at once is its graceful stop. Without this, Python's default action
    ends it with -15, which its supervisor reads as a crash (``dart run`` stopping a service it had just
    restarted). Call it first thing in the process; :func:`dart.runtime.serving.serve` installs the
    loop's own handlers, and a launcher or a follower rank its own.
    """

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, leave)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies.

    Returns None where the platform has no such mechanism (not Linux), so it can be passed to
    :class:`subprocess.Popen` unconditionally. The parent's pid is captured now, so a parent that
    died between fork and the ``prctl`` call is noticed and the child exits at once.
    """
    if _LIBC is None:
        return None
    libc = _LIBC
    parent = os.getpid()

    def preexec() -> None:
        # Runs in the child between fork and exec: async-signal-safe calls only, no Python-level locks.
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


_REAPER_CODE = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    sign, group = line[:1], line[1:].strip()
    if group.isdigit():
        (groups.add if sign == "+" else groups.discard)(int(group))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""
"""The sidecar: registers ``+PGID`` and unregisters ``-PGID`` lines until EOF, then kills what is left."""


class _GroupReaper:
    """The sidecar process and the write end of its pipe (never inherited by children: O_CLOEXEC)."""

    def __init__(self) -> None:
        read_end, self._write_end = os.pipe()
        try:
            # Its own session: a kill of this process's group (a supervisor stopping it) spares the sidecar.
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _REAPER_CODE],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(read_end)
        self._lock = threading.Lock()

    def send(self, line: str) -> None:
        with self._lock:
            os.write(self._write_end, line.encode())


_reaper: _GroupReaper | None = None
_reaper_lock = threading.Lock()


def reap_group_with_this_process(pgid: int) -> None:
    """Have process group ``pgid`` killed (SIGKILL) once this process has ended, however it ends.

    For a child started in its own session (``start_new_session=True``) whose descendants stay in its
    group. Call :func:`release_group` once this process has stopped the group itself.
    """
    global _reaper
    with _reaper_lock:
        if _reaper is None or _reaper.process.poll() is not None:
            _reaper = _GroupReaper()
        reaper = _reaper
    reaper.send(f"+{pgid}\n")


def release_group(pgid: int) -> None:
    """Forget ``pgid`` (this process stopped it): the sidecar will not kill a group that may reuse the id."""
    with _reaper_lock:
        reaper = _reaper
    if reaper is not None and reaper.process.poll() is None:
        reaper.send(f"-{pgid}\n")
