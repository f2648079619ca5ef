"""Backoff delays, pause, and retry / retry_call / retry_async: repeat while the error is transient, raise
anything else (and the last) unchanged, end at once on cancellation or a stop."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

import pytest

from dart.protocol.errors import IntegrityError, StoreUnavailableError
from dart.runtime.retry import Backoff, RetryPolicy, pause, retry, retry_async, retry_call

pytestmark = pytest.mark.unit

FAST = RetryPolicy(attempts=4, initial_delay_s=0.0, jitter=0.0)


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, StoreUnavailableError)


class FailsFirst:
    """A call that raises ``error`` on its first ``n`` tries, then returns its try count."""

    def __init__(self, n: int, error: Exception) -> None:
        self.n, self.error, self.tries = n, error, 0

    def __call__(self) -> int:
        self.tries += 1
        if self.tries <= self.n:
            raise self.error
        return self.tries


def test_a_transient_error_is_retried_until_the_call_succeeds() -> None:
    call = FailsFirst(3, StoreUnavailableError("s3:9000", "connection refused"))
    assert retry_call(call, policy=FAST, retryable=_transient, what="read") == 4


def test_the_last_error_is_raised_unchanged_once_attempts_are_spent() -> None:
    error = StoreUnavailableError("s3:9000", "connection refused")
    call = FailsFirst(10, error)
    with pytest.raises(StoreUnavailableError) as raised:
        retry_call(call, policy=FAST, retryable=_transient, what="read")
    assert raised.value is error and call.tries == 4


def test_an_error_that_is_not_retryable_is_raised_at_the_first_try() -> None:
    call = FailsFirst(1, IntegrityError("file:///x", "a" * 64, "b" * 64))
    with pytest.raises(IntegrityError):
        retry_call(call, policy=FAST, retryable=_transient, what="read")
    assert call.tries == 1


def test_delays_grow_geometrically_up_to_the_cap_and_jitter_only_shortens_them() -> None:
    policy = RetryPolicy(attempts=6, initial_delay_s=0.1, multiplier=2.0, max_delay_s=0.5, jitter=0.0)
    slept: list[float] = []
    with pytest.raises(StoreUnavailableError):
        retry_call(
            FailsFirst(10, StoreUnavailableError("s3", "down")),
            policy=policy,
            retryable=_transient,
            what="read",
            sleep=slept.append,
        )
    assert slept == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    jittered = policy.model_copy(update={"jitter": 0.5})
    assert all(0.25 <= jittered.delay_s(5) <= 0.5 for _ in range(50))


async def test_the_async_variant_retries_the_same_way() -> None:
    call = FailsFirst(2, StoreUnavailableError("s3:9000", "connection refused"))

    async def attempt() -> int:
        return call()

    assert await retry_async(attempt, policy=FAST, retryable=_transient, what="reload") == 3
    corrupt = FailsFirst(5, IntegrityError("file:///x", "a" * 64, "b" * 64))

    async def corrupt_attempt() -> int:
        return corrupt()

    with pytest.raises(IntegrityError):
        await retry_async(corrupt_attempt, policy=FAST, retryable=_transient, what="reload")
    assert corrupt.tries == 1


def test_backoff_delays_double_up_to_the_cap() -> None:
    delays = Backoff(0.1, max_s=0.5).delays()
    assert [next(delays) for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5, 0.5])
    assert [Backoff(1.0, factor=3.0).delay_s(n) for n in (1, 2, 3)] == [1.0, 3.0, 9.0]


def test_backoff_never_overflows_and_a_zero_delay_stays_zero() -> None:
    assert Backoff(1.0, max_s=60.0).delay_s(100_000) == 60.0
    assert Backoff(1.0).delay_s(100_000) == math.inf  # unbounded: the caller bounds the tries
    assert Backoff(0.0).delay_s(100_000) == 0.0


def test_a_new_iterator_starts_again_at_the_first_delay() -> None:
    backoff = Backoff(1.0, max_s=8.0)
    failing = backoff.delays()
    assert [next(failing) for _ in range(4)] == [1.0, 2.0, 4.0, 8.0]
    reset = backoff.delays()  # what a loop does after a success
    assert next(reset) == 1.0 and next(failing) == 8.0


def test_jitter_only_shortens_a_delay() -> None:
    backoff = Backoff(4.0, jitter=0.5)
    samples = [backoff.delay_s(1) for _ in range(200)]
    assert all(2.0 <= d <= 4.0 for d in samples) and len(set(samples)) > 1


@pytest.mark.parametrize(
    "bad", [{"initial_s": -1.0}, {"max_s": -1.0}, {"factor": 0.5}, {"jitter": 1.5}], ids=lambda b: next(iter(b))
)
def test_invalid_backoffs_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="invalid Backoff"):
        Backoff(**{"initial_s": 1.0, **bad})
    with pytest.raises(ValueError, match="start at 1"):
        Backoff(1.0).delay_s(0)


def test_the_policy_and_its_backoff_agree() -> None:
    policy = RetryPolicy(initial_delay_s=0.3, multiplier=3.0, max_delay_s=2.0, jitter=0.0)
    assert policy.backoff == Backoff(0.3, max_s=2.0, factor=3.0)
    assert [policy.delay_s(n) for n in (1, 2, 3)] == pytest.approx([0.3, 0.9, 2.0])


def _async(call: FailsFirst, tried: asyncio.Event | None = None) -> Callable[[], Awaitable[int]]:
    async def attempt() -> int:
        if tried is not None:
            tried.set()
        return call()

    return attempt


async def test_retry_repeats_until_success_and_logs_each_retry_on_the_callers_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    call = FailsFirst(3, StoreUnavailableError("s3:9000", "connection refused"))
    mine = logging.getLogger("dart.test.retry")
    with caplog.at_level(logging.WARNING, logger="dart.test.retry"):
        assert await retry(_async(call), backoff=Backoff(0.0), retryable=_transient, what="read", logger=mine) == 4
    retries = [r.getMessage() for r in caplog.records if r.name == "dart.test.retry"]
    assert len(retries) == 3 and retries[0].startswith("read failed (try 1), retrying in 0.00s")


async def test_retry_without_a_limit_keeps_going_and_a_rejected_error_ends_it() -> None:
    call = FailsFirst(50, StoreUnavailableError("s3", "down"))
    assert await retry(_async(call), backoff=Backoff(0.0), retryable=_transient, what="read") == 51
    corrupt = FailsFirst(5, IntegrityError("file:///x", "a" * 64, "b" * 64))
    with pytest.raises(IntegrityError):
        await retry(_async(corrupt), backoff=Backoff(0.0), retryable=_transient, what="read")
    assert corrupt.tries == 1


async def test_retry_gives_up_when_the_next_delay_would_pass_the_time_limit() -> None:
    error = StoreUnavailableError("s3", "down")
    call = FailsFirst(10, error)
    # The first delay (60 s) already ends past the limit (1 s): the first error is raised, without a wait.
    with pytest.raises(StoreUnavailableError) as raised:
        await retry(_async(call), backoff=Backoff(60.0), timeout_s=1.0, retryable=_transient, what="read")
    assert raised.value is error and call.tries == 1


async def test_a_stop_event_cuts_the_wait_short_and_the_last_error_is_raised() -> None:
    error = StoreUnavailableError("s3", "down")
    call = FailsFirst(10, error)
    stop, tried = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        retry(_async(call, tried), backoff=Backoff(600.0), stop=stop, retryable=_transient, what="r")
    )
    await tried.wait()
    stop.set()
    async with asyncio.timeout(10.0):  # generous: the wait was 600 s
        with pytest.raises(StoreUnavailableError) as raised:
            await task
    assert raised.value is error and call.tries == 1


async def test_cancelling_a_retry_ends_its_wait_at_once() -> None:
    call = FailsFirst(10, StoreUnavailableError("s3", "down"))
    stop, tried = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        retry(_async(call, tried), backoff=Backoff(600.0), stop=stop, retryable=_transient, what="r")
    )
    await tried.wait()
    task.cancel()
    async with asyncio.timeout(10.0):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert call.tries == 1


async def test_pause_waits_its_delay_or_until_woken() -> None:
    wake = asyncio.Event()
    assert await pause(0.01, wake=wake) is False
    assert await pause(0.0) is False
    waiting = asyncio.create_task(pause(600.0, wake=wake))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    wake.set()
    async with asyncio.timeout(10.0):
        assert await waiting is True
    assert wake.is_set()  # left for the caller to clear


@pytest.mark.parametrize("with_event", [True, False], ids=["event", "plain"])
async def test_cancelling_a_pause_propagates_at_once(with_event: bool) -> None:
    waiting = asyncio.create_task(pause(600.0, wake=asyncio.Event() if with_event else None))
    await asyncio.sleep(0.01)
    waiting.cancel()
    async with asyncio.timeout(10.0):
        with pytest.raises(asyncio.CancelledError):
            await waiting
