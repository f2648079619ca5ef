"""wait_event never turns a cancellation into a timeout (asyncio.wait_for on Python 3.11 can); cancel_and_wait
ends tasks that swallowed one."""

from __future__ import annotations

import asyncio

import pytest

from dart.runtime.waiting import cancel_and_wait, wait_event

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


async def test_cancel_and_wait_asks_again_until_a_task_that_swallowed_a_cancel_ends() -> None:
    """A task that swallows its first cancellation (as a library's wait_for can) still ends; what the
    others raised is not raised."""
    swallowed = asyncio.Event()

    async def swallows_once() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            swallowed.set()  # a loop around a wait_for that returned a result instead
        await asyncio.sleep(60)

    async def fails() -> None:
        raise RuntimeError("not raised by cancel_and_wait")

    stubborn, failing = asyncio.create_task(swallows_once()), asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait([stubborn, failing], again_after_s=0.05)
    assert swallowed.is_set() and stubborn.cancelled()
    assert isinstance(failing.exception(), RuntimeError)
    await cancel_and_wait([])  # nothing to do
