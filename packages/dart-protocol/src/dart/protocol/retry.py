"""Retry with exponential backoff, written once for every package.

Usage::

    policy = RetryPolicy(attempts=5, initial_delay_s=0.2)
    data = retry_call(lambda: store.get(key), policy=policy, retryable=is_transient, what=f"read {uri}")
    reply = await retry_async(lambda: client.post(url), policy=policy, retryable=is_transient, what="reload")

A call is repeated only while ``retryable(exc)`` says its error may go away (a refused connection, a
5xx answer); any other error, and the last one once ``policy.attempts`` are spent, is raised unchanged,
so callers keep catching the types they know. Each repeat is logged at WARNING with ``what``. The
helper bounds the number of tries, not each try's duration: the call itself must carry its own timeout
(store and bus clients do).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pydantic import Field

from dart.protocol.config import ConfigModel

T = TypeVar("T")

log = logging.getLogger("dart.retry")


class RetryPolicy(ConfigModel):
    """How often and how patiently a failing call is repeated.

    The delay before retry ``n`` (1-based) is ``min(initial_delay_s * multiplier**(n-1), max_delay_s)``,
    scaled down by a random factor in ``[1 - jitter, 1]`` so that processes failing together (the ranks
    of one trainer, the engines of one run) do not retry in lockstep.
    """

    attempts: int = Field(default=5, ge=1)
    """Tries in all, the first included; 1 never retries."""
    initial_delay_s: float = Field(default=0.2, ge=0.0)
    """Delay before the first retry, seconds."""
    multiplier: float = Field(default=2.0, ge=1.0)
    """Growth of the delay from one retry to the next."""
    max_delay_s: float = Field(default=5.0, ge=0.0)
    """Longest delay between two tries, seconds."""
    jitter: float = Field(default=0.2, ge=0.0, le=1.0)
    """Fraction of each delay that is randomized away (0: exact delays)."""

    def delay_s(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        base = min(self.initial_delay_s * self.multiplier ** (retry - 1), self.max_delay_s)
        return base * (1.0 - self.jitter * random.random())


def retry_call(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    retryable: Callable[[BaseException], bool],
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``fn()``, repeated with backoff while it raises an error ``retryable`` accepts (blocking).

    Raises:
        Exception: ``fn``'s own error: one ``retryable`` rejects at once, or the last after ``policy.attempts`` tries.
    """
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == policy.attempts or not retryable(exc):
                raise
            delay = policy.delay_s(attempt)
            log.warning("%s failed (try %d of %d), retrying in %.2fs: %s", what, attempt, policy.attempts, delay, exc)
            sleep(delay)
    raise AssertionError("unreachable: the last try returns or raises")


async def retry_async(
    fn: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    retryable: Callable[[BaseException], bool],
    what: str,
) -> T:
    """``await fn()``, repeated with backoff (``asyncio.sleep``) while it raises an error ``retryable`` accepts.

    Raises:
        Exception: ``fn``'s own error: one ``retryable`` rejects at once, or the last after ``policy.attempts`` tries.
    """
    for attempt in range(1, policy.attempts + 1):
        try:
            return await fn()
        except Exception as exc:
            if attempt == policy.attempts or not retryable(exc):
                raise
            delay = policy.delay_s(attempt)
            log.warning("%s failed (try %d of %d), retrying in %.2fs: %s", what, attempt, policy.attempts, delay, exc)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable: the last try returns or raises")
