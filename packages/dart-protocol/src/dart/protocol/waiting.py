"""Waiting for an event with a timeout without losing a cancellation.

On Python 3.11, ``asyncio.wait_for(event.wait(), t)`` turns a cancellation that arrives as its timeout
expires into a ``TimeoutError``: a loop that treats the timeout as "poll again" then swallows its own
cancellation and never ends (a service's ``stop`` waited forever on such a loop). ``asyncio.timeout``
counts cancellations and re-raises one it did not cause; :func:`wait_event` is built on it.
"""

from __future__ import annotations

import asyncio


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
