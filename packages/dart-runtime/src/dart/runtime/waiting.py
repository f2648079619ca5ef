"""Waiting for an event with a timeout without losing a cancellation.

On Python 3.11, ``asyncio.wait_for(event.wait(), t)`` turns a cancellation that arrives as its timeout
expires into a ``TimeoutError``: a loop that treats the timeout as "poll again" then swallows its own
cancellation and never ends (a service's ``stop`` waited forever on such a loop). ``asyncio.timeout``
counts cancellations and re-raises one it did not cause; :func:`wait_event` is built on it. Where the
``wait_for`` is inside a library, :func:`cancel_and_wait` asks again until the task has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set, at most ``timeout_s`` seconds; True when it is set.

    Raises:
        asyncio.CancelledError: The waiting task was cancelled (never reported as a timeout).
    """
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], *, again_after_s: float = 1.0) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again every ``again_after_s``
    seconds those still running.

    A library that waits with ``asyncio.wait_for`` (nats-py does, for messages and watches) can swallow
    a cancellation on Python 3.11: a task looping around such a wait runs on after one cancel, and a
    ``stop`` that cancels once and gathers never returns. What the tasks raised is not raised here (as
    ``gather(..., return_exceptions=True)``).
    """
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_after_s)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: not reported as never retrieved
