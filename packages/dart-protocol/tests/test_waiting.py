"""wait_event never turns a cancellation into a timeout (asyncio.wait_for on Python 3.11 can)."""

from __future__ import annotations

import asyncio

import pytest

from dart.protocol.waiting import wait_event

pytestmark = pytest.mark.unit


async def test_set_and_unset() -> None:
    event = asyncio.Event()
    assert not await wait_event(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 10.0)
    assert await wait_event(event, 0.0)  # already set


@pytest.mark.parametrize("yields", [0, 1, 2, 3])
async def test_a_cancel_that_comes_as_the_event_is_set_ends_a_polling_loop(yields: int) -> None:
    """The event is set and the task cancelled within a few loop iterations, as a service's stop can do
    while work finishes. ``asyncio.wait_for`` on Python 3.11 returns the event and drops the cancel for
    0, 1 and 2 iterations between them (the loop then polls forever); ``wait_event`` must not."""
    event = asyncio.Event()

    async def poll() -> None:
        while True:  # a service's polling loop: wait for the event, act, wait again
            await wait_event(event, 10.0)
            event.clear()

    task = asyncio.create_task(poll())
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the task waits on the event now
    event.set()
    for _ in range(yields):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=10.0)
    assert done == {task}, "the cancellation was swallowed: the loop kept polling"
    assert task.cancelled()
