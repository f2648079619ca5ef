"""Retry and backoff, written once for every package.

:class:`Backoff` is the one formula for waits that grow while something keeps failing; every loop that
waits between tries (a restart, a lease request, a weight sync, an announcement) takes its delays from
it. On top of it:

- :func:`retry` (async) repeats a call while it raises an error the caller calls transient, bounded by
  a number of tries, a time limit, or a stop event; :func:`retry_async` and :func:`retry_call` (blocking)
  do the same with a :class:`RetryPolicy`, the config form of a bounded backoff.
- :func:`pause` is the cancellation-safe wait between two tries of a loop that keeps its own state; a
  stop (or "try now") event cuts it short.

Usage::

    policy = RetryPolicy(attempts=5, initial_delay_s=0.2)
    data = retry_call(lambda: store.get(key), policy=policy, retryable=is_transient, what=f"read {uri}")
    reply = await retry(
        lambda: bus.js_publish(subject, model),
        backoff=Backoff(0.5, max_s=5.0),
        timeout_s=300.0,
        retryable=lambda exc: isinstance(exc, JetStreamError),
        what="announce",
    )

    backoff = Backoff(1.0, max_s=30.0)   # a loop that keeps its own state
    delays = backoff.delays()
    while not stopped:
        if await restart():
            delays = backoff.delays()     # a success resets the delay
        else:
            await pause(next(delays), wake=stop_event)

A call is repeated only while ``retryable(exc)`` says its error may go away (a refused connection, a
5xx answer); any other error, and the last one once the tries are spent, is raised unchanged, so
callers keep catching the types they know. Each repeat is logged with ``what``. The helpers bound the
number of tries (or the time spent), not each try's duration: the call itself must carry its own
timeout (store and bus clients do).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from pydantic import Field

from dart.protocol.config import ConfigModel
from dart.runtime.waiting import wait_event

T = TypeVar("T")

log = logging.getLogger("dart.retry")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: the delays between the tries of something that keeps failing.

    Delay ``n`` (1 for the wait after the first failure) is ``min(initial_s * factor**(n-1), max_s)``,
    scaled down by a random factor in ``[1 - jitter, 1]`` so that processes failing together (the ranks
    of one trainer, the engines of one run) do not retry in lockstep.

    A value, not a timer: a loop takes an iterator from :meth:`delays` and starts a new one where its
    failures reset (a success, a new version to apply).

    Attributes:
        initial_s: First delay, seconds.
        max_s: Longest delay, seconds (unbounded by default).
        factor: Growth of the delay from one try to the next (2 doubles it).
        jitter: Fraction of each delay that may be randomized away (0: exact delays).
    """

    initial_s: float
    max_s: float = math.inf
    factor: float = 2.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not (self.initial_s >= 0 and self.max_s >= 0 and self.factor >= 1 and 0 <= self.jitter <= 1):
            raise ValueError(f"invalid {self!r}: need initial_s >= 0, max_s >= 0, factor >= 1 and 0 <= jitter <= 1")

    def delay_s(self, n: int) -> float:
        """Seconds to wait after failure number ``n`` (1-based)."""
        if n < 1:
            raise ValueError(f"failure numbers start at 1, not {n}")
        try:
            grown = self.initial_s * self.factor ** (n - 1) if self.initial_s else 0.0
        except OverflowError:  # float powers overflow long before a loop of waits would notice
            grown = math.inf
        base = min(grown, self.max_s)
        return base * (1.0 - self.jitter * random.random()) if self.jitter else base

    def delays(self) -> Iterator[float]:
        """The delays after the 1st, 2nd, ... failure, without end."""
        n = 1
        while True:
            yield self.delay_s(n)
            n += 1


async def pause(delay_s: float, *, wake: asyncio.Event | None = None) -> bool:
    """Wait ``delay_s`` seconds, or until ``wake`` is set; True when ``wake`` cut the wait short.

    ``wake`` is left as it is (the caller decides whether to clear it). Cancelling the waiting task
    ends the wait at once and is never reported as a timeout (see :mod:`dart.runtime.waiting`).

    Raises:
        asyncio.CancelledError: The waiting task was cancelled.
    """
    if wake is None:
        await asyncio.sleep(delay_s)
        return False
    return await wait_event(wake, delay_s)


async def retry(
    fn: Callable[[], Awaitable[T]],
    *,
    backoff: Backoff,
    retryable: Callable[[BaseException], bool],
    what: str,
    attempts: int | None = None,
    timeout_s: float | None = None,
    stop: asyncio.Event | None = None,
    logger: logging.Logger = log,
    log_level: int = logging.WARNING,
) -> T:
    """``await fn()``, repeated after ``backoff``'s delays while it raises an error ``retryable`` accepts.

    Args:
        fn: Makes one try (a new awaitable per call).
        backoff: The delays between tries.
        retryable: Whether an error may go away by trying again.
        what: What is tried, for the log (``announce version 3``).
        attempts: Tries in all, the first included; None for no limit.
        timeout_s: Give up rather than wait past this many seconds after the first try; None for no limit.
        stop: Give up once it is set; setting it also cuts a wait short.
        logger: Where each retry is logged (the caller's logger, so its records keep their name).
        log_level: Level of those records (DEBUG where retrying is routine, e.g. a full pool).

    Raises:
        Exception: ``fn``'s own error: one ``retryable`` rejects at once, or the last when the tries,
            the time or ``stop`` ran out.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    tries = "" if attempts is None else f" of {attempts}"
    delays = backoff.delays()
    attempt = 0
    while True:
        attempt += 1
        try:
            return await fn()
        except Exception as exc:
            delay = next(delays)
            out_of_time = deadline is not None and time.monotonic() + delay > deadline
            if not retryable(exc) or attempt == attempts or out_of_time or (stop is not None and stop.is_set()):
                raise
            logger.log(log_level, "%s failed (try %d%s), retrying in %.2fs: %s", what, attempt, tries, delay, exc)
            last = exc
        if await pause(delay, wake=stop):
            raise last  # stopped while waiting: the caller gets the error it would have got last


class RetryPolicy(ConfigModel):
    """How often and how patiently a failing call is repeated (the config form of a bounded :class:`Backoff`).

    The delay before retry ``n`` (1-based) is ``min(initial_delay_s * multiplier**(n-1), max_delay_s)``,
    scaled down by a random factor in ``[1 - jitter, 1]`` (see :class:`Backoff`).
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

    @property
    def backoff(self) -> Backoff:
        """The delays between tries, as a :class:`Backoff`."""
        return Backoff(self.initial_delay_s, max_s=self.max_delay_s, factor=self.multiplier, jitter=self.jitter)

    def delay_s(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        return self.backoff.delay_s(retry)


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
    for attempt, delay in enumerate(policy.backoff.delays(), 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == policy.attempts or not retryable(exc):
                raise
            log.warning("%s failed (try %d of %d), retrying in %.2fs: %s", what, attempt, policy.attempts, delay, exc)
        sleep(delay)
    raise AssertionError("unreachable: Backoff.delays() never ends")


async def retry_async(
    fn: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    retryable: Callable[[BaseException], bool],
    what: str,
) -> T:
    """``await fn()``, repeated with backoff while it raises an error ``retryable`` accepts (:func:`retry`).

    Raises:
        Exception: ``fn``'s own error: one ``retryable`` rejects at once, or the last after ``policy.attempts`` tries.
    """
    return await retry(fn, backoff=policy.backoff, retryable=retryable, what=what, attempts=policy.attempts)
