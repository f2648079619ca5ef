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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
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
