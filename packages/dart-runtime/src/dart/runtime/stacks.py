"""What a stuck process is waiting on: its threads' and its asyncio tasks' stacks, on a signal.

A service that does not stop is killed by whoever stops it (``dart run`` after ``run.stop_timeout_s``,
docker after its grace period), and the kill leaves nothing saying where it hung. Before killing a
``dart serve`` process, ``dart run`` sends it :data:`DUMP_SIGNAL`; the process then writes

- every thread's Python stack (:mod:`faulthandler`, from the signal handler itself, so it works even
  while the event loop is blocked), and
- every asyncio task's stack (logged from the event loop: where each coroutine is suspended, which is
  what an asynchronous hang looks like),

to its stderr, which is the end of its log file. By hand: ``kill -USR1 <pid>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import io
import logging
import signal
import sys

log = logging.getLogger(__name__)

DUMP_SIGNAL = signal.SIGUSR1
"""The signal that makes a served process write its stacks."""


def dump_stacks_on_signal(loop: asyncio.AbstractEventLoop) -> None:
    """From now on, :data:`DUMP_SIGNAL` writes every thread's and every task of ``loop``'s stack to stderr."""
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(DUMP_SIGNAL, log_tasks, loop)
    # After the loop's handler, which faulthandler then calls on (chain): threads first, tasks after.
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=True)


def log_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Log where each of ``loop``'s tasks is suspended (one record for all of them)."""
    out = io.StringIO()
    tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
    for task in tasks:
        out.write(f"\n--- {task!r}\n")
        for line in await_chain(task.get_coro()):
            out.write(f"  {line}\n")
    log.warning("%d asyncio tasks:%s", len(tasks), out.getvalue())


def await_chain(coro: object) -> list[str]:
    """Where a suspended coroutine waits, outermost first: ``file:line in function`` down its awaits.

    ``Task.print_stack`` shows only a task's outermost frame, which for a service is ``serve``; the
    hang is at the bottom of the chain of coroutines it awaits.
    """
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        code = frame.f_code
        lines.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return lines
