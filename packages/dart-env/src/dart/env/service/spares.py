"""Warm spares: env backends started ahead of need, so a crashed instance is replaced without a start wait."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dart.env.interface import BackendFactory, EnvBackend
from dart.env.service.config import EnvServiceConfig
from dart.runtime.retry import Backoff, pause

log = logging.getLogger("dart.env.service")

SPARE_STREAM_BASE = 1 << 30
"""Spares draw their randomness streams from here up, apart from the slots' own streams."""
MAX_START_BACKOFF_S = 60.0
"""Longest pause between two failed spare starts, seconds."""


async def start_or_close(
    backend: EnvBackend, start: Callable[[EnvBackend], Awaitable[None]], close: Callable[[EnvBackend], Awaitable[None]]
) -> Exception | None:
    """Start ``backend``; where it fails, close it and return the error (None: it started). Cancelled (the service
    is stopping), it is closed too, so no half-started env outlives the service, and the cancellation goes on."""
    try:
        await start(backend)
    except asyncio.CancelledError:
        await close(backend)
        raise
    except Exception as exc:
        await close(backend)
        return exc
    return None


@dataclass(frozen=True)
class SpareStats:
    """The warm-spare pool's counters.

    Attributes:
        target: How many spares the service keeps (``warm_spares``).
        ready: Spares started and waiting now.
        used: Crashed instances replaced by a spare.
        start_failures: Spares that failed to start.
    """

    target: int
    ready: int
    used: int
    start_failures: int


class SparePool:
    """Keeps ``config.warm_spares`` backends started, and hands one out when an instance crashes.

    Pool lifecycle, driven by :class:`~dart.env.service.service.EnvService`: :meth:`start` once it
    serves, :meth:`stop` and then :meth:`close` when it stops::

        created --start()--> keeping --stop()--> stopped --close()--> closed

    While ``keeping``, one background task (the keeper) tops the pool up, one start at a time.
    Lifecycle of one spare::

        starting --started--> ready --take()--> in a slot (the pool no longer owns it)
           |                    +-----close()--> closed
           +--start failed--> closed; the keeper waits restart_backoff_s (doubling, at most
                              MAX_START_BACKOFF_S; reset by the next spare that starts) and tries again

    :meth:`take` is called by the service when an instance crashes; it wakes the keeper to start a
    replacement spare. A spare whose start ends after :meth:`stop` began is left ready and closed by
    :meth:`close`, so none outlives the service.

    Args:
        config: The pool's config (``warm_spares``, ``restart_backoff_s``, ``pool`` for the log).
        factory: Makes a backend for a randomness stream.
        start: Starts a backend (raising when it fails or takes too long).
        close: Closes a backend (never raising).
    """

    def __init__(
        self,
        config: EnvServiceConfig,
        factory: BackendFactory,
        *,
        start: Callable[[EnvBackend], Awaitable[None]],
        close: Callable[[EnvBackend], Awaitable[None]],
    ) -> None:
        self._config = config
        self._factory = factory
        self._start = start
        self._close = close
        self._ready: list[EnvBackend] = []
        self._used = 0
        self._start_failures = 0
        self._streams = 0
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._keeper: asyncio.Task[None] | None = None

    @property
    def ready(self) -> tuple[EnvBackend, ...]:
        """The spares started and waiting, the next one :meth:`take` hands out first."""
        return tuple(self._ready)

    def stats(self) -> SpareStats:
        """The pool's counters."""
        return SpareStats(self._config.warm_spares, len(self._ready), self._used, self._start_failures)

    def start(self) -> None:
        """Start keeping ``warm_spares`` backends ready in the background (nothing when it is 0)."""
        if self._config.warm_spares and self._keeper is None:
            self._keeper = asyncio.create_task(self._keep(), name=f"spares {self._config.pool}")

    def take(self) -> EnvBackend | None:
        """A ready spare, now the caller's to run and close; None when none is ready."""
        if not self._ready:
            return None
        self._used += 1
        self._wakeup.set()  # the keeper starts the next one
        return self._ready.pop(0)

    async def stop(self) -> None:
        """Stop topping the pool up: the keeper is cancelled (a spare it was starting is closed)."""
        self._stopping = True
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)

    async def close(self) -> None:
        """Close every ready spare (after :meth:`stop`)."""
        spares, self._ready = self._ready, []
        await asyncio.gather(*(self._close(spare) for spare in spares))

    async def _keep(self) -> None:
        backoff = Backoff(self._config.restart_backoff_s, max_s=MAX_START_BACKOFF_S)
        delays = backoff.delays()
        while not self._stopping:
            if len(self._ready) >= self._config.warm_spares:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            backend = self._factory(self._config, SPARE_STREAM_BASE + self._streams)
            self._streams += 1
            failed = await start_or_close(backend, self._start, self._close)
            if failed is not None:
                self._start_failures += 1
                log.warning("starting a warm spare for pool %s failed: %r", self._config.pool, failed)
                await pause(next(delays))
                continue
            delays = backoff.delays()  # a spare that started resets the delay
            self._ready.append(backend)
