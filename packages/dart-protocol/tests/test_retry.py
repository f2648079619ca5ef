"""retry_call / retry_async: repeat while the error is transient, raise anything else (and the last) unchanged."""

from __future__ import annotations

import pytest

from dart.protocol.errors import IntegrityError, StoreUnavailableError
from dart.protocol.retry import RetryPolicy, retry_async, retry_call

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
