"""Instance keeping: what keeps each slot of an env pool holding a sound backend, apart from the leases and calls
the env service serves.

A backend that failed a call is replaced in the background under the same instance id: by a warm spare at once
when one is ready (:class:`~dart.env.service.spares.SparePool`), else by a new backend, restarted with backoff until
``env.max_consecutive_failures`` retires the slot. A backend past a recycle limit (:mod:`dart.env.service.health`),
or spent (it cannot start another clean episode), is swapped for a fresh one once its lease ends. What leaves a
slot is closed in the background; :meth:`InstanceKeeper.stop` waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from dart.env.interface import EnvBackend
from dart.env.service.config import EnvServiceConfig
from dart.env.service.health import InstanceHealth, processes_rss_mib, recycle_reason
from dart.env.service.instance import InstanceSlot, SlotState
from dart.env.service.lease import EndReason
from dart.env.service.lease_book import LeaseBook
from dart.env.service.spares import SparePool, start_or_close
from dart.runtime.retry import Backoff, pause
from dart.runtime.telemetry import Telemetry
from dart.runtime.waiting import cancel_and_wait

log = logging.getLogger("dart.env.service")

_CLOSE_TIMEOUT_S = 10.0
"""How long closing a crashed or stopping backend may take before it is abandoned, seconds."""


class InstanceKeeper:
    """Replaces failed backends, recycles worn ones and closes what leaves a slot (see the module docstring).

    Args:
        config: The pool's config (timeouts, recycle limits, the breaker, spares).
        factory: Makes the ``n``-th backend of the pool (``ENV_BACKENDS``'s factory).
        leases: The service's lease book (a failed instance's lease ends there).
        telemetry: Where ``env.instance_failed``, ``_replaced`` and ``_recycled`` events go; None: nowhere.
    """

    def __init__(
        self,
        config: EnvServiceConfig,
        factory: Callable[[EnvServiceConfig, int], EnvBackend],
        leases: LeaseBook,
        telemetry: Telemetry | None,
    ) -> None:
        self.config = config
        self._factory = factory
        self._leases = leases
        self._telemetry = telemetry
        self.spares = SparePool(config, factory, start=self.start_backend, close=self.close_backend)
        """Warm spare backends, taken first by a replacement or a recycle."""
        self.stopping = False
        """Set when the service stops: nothing is recycled from then on."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Start warming spares (once the pool serves)."""
        self.spares.start()

    async def stop(self) -> None:
        """Cancel replacements and recycles in flight and the spares' warming, then wait for the backends being
        closed (waited for, not cancelled: a half-closed browser or desktop would outlive the service)."""
        self.stopping = True
        await asyncio.gather(cancel_and_wait(list(self._tasks)), self.spares.stop(), return_exceptions=True)
        await asyncio.gather(*self._closing, return_exceptions=True)

    async def close(self, backends: Iterable[EnvBackend]) -> None:
        """Close ``backends`` (the slots' own at the service's stop) and the spares."""
        await asyncio.gather(*(self.close_backend(b) for b in backends), self.spares.close())

    def fail(self, slot: InstanceSlot, op: str, exc: BaseException) -> None:
        """End the slot's lease (``env_failed``) and replace its backend in the background."""
        log.warning("instance %s failed during %s: %r; replacing it", slot.instance_id, op, exc)
        slot.failures += 1
        slot.consecutive_failures += 1
        self._leases.end(slot, EndReason.ENV_FAILED)
        slot.state = SlotState.REPLACING
        if self._telemetry is not None:
            self._telemetry.event(
                "env.instance_failed",
                instance_id=slot.instance_id,
                backend=self.config.backend,
                op=op,
                error=f"{type(exc).__name__}: {exc}"[:500],
                consecutive_failures=slot.consecutive_failures,
            )
        self._background(self._replace(slot, slot.backend), f"replace {slot.instance_id}")

    def recycle_if_due(self, slot: InstanceSlot) -> None:
        """Measure a just-freed instance; past a recycle limit, or spent (it cannot start another clean
        episode), swap its backend for a fresh one."""
        slot.rss_mib = processes_rss_mib(slot.backend.process_ids())
        spent = slot.backend.spent
        reason = "single_use" if spent else recycle_reason(slot.health, slot.rss_mib, self.config.recycle)
        if reason is None or self.stopping or slot.state != SlotState.FREE:
            return
        slot.state = SlotState.REPLACING  # not leasable until the fresh backend is in
        log.info("recycling instance %s (%s)", slot.instance_id, reason)
        self._background(self._recycle(slot, reason), f"recycle {slot.instance_id}")

    async def _recycle(self, slot: InstanceSlot, reason: str) -> None:
        started = time.monotonic()
        worn, health, rss_mib = slot.backend, slot.health, slot.rss_mib
        fresh = self.spares.take()
        from_spare = fresh is not None
        if fresh is None:
            fresh = self._factory(self.config, slot.index + (slot.generation + 1) * self.config.instances)
            failed = await start_or_close(fresh, self.start_backend, self.close_backend)
            if failed is not None:
                if worn.spent:
                    # The old backend cannot give a clean episode: the slot is restarted like a crashed one.
                    self.fail(slot, "recycle", failed)
                    return
                # The worn backend still works: it serves on, and the next release tries again.
                log.warning("starting a fresh backend for %s failed: %r; keeping the old one", slot.instance_id, failed)
                slot.free()
                return
        self._close_meanwhile(worn, f"close worn {slot.instance_id}")
        slot.generation += 1
        slot.recycles[reason] = slot.recycles.get(reason, 0) + 1
        self._install(slot, fresh)
        if self._telemetry is not None:
            self._telemetry.event(
                "env.instance_recycled",
                instance_id=slot.instance_id,
                backend=self.config.backend,
                reason=reason,
                episodes=health.episodes,
                rss_mib=round(rss_mib, 1),
                step_latency_ratio=round(health.step_latency_ratio, 3),
                generation=slot.generation,
                from_spare=from_spare,
                took_s=time.monotonic() - started,
            )

    def _background(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _install(self, slot: InstanceSlot, backend: EnvBackend) -> None:
        """Put a started backend in the slot, with a fresh health record, and make the slot leasable."""
        slot.backend = backend
        slot.health = InstanceHealth(self.config.recycle.latency_window)
        slot.rss_mib = 0.0
        slot.last_task_id = None
        slot.free()

    def _close_meanwhile(self, backend: EnvBackend, name: str) -> None:
        """Close a backend that left its slot in the background (``stop`` waits for it)."""
        closing = asyncio.create_task(self.close_backend(backend), name=name)
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    def _replaced(self, slot: InstanceSlot, backend: EnvBackend, started: float, *, spare: bool) -> None:
        slot.restarts += 1
        self._install(slot, backend)
        log.info("instance %s replaced (generation %d%s)", slot.instance_id, slot.generation, ", a spare" * spare)
        if self._telemetry is not None:
            self._telemetry.event(
                "env.instance_replaced",
                instance_id=slot.instance_id,
                backend=self.config.backend,
                generation=slot.generation,
                from_spare=spare,
                took_s=time.monotonic() - started,
            )

    async def _replace(self, slot: InstanceSlot, crashed: EnvBackend) -> None:
        started = time.monotonic()
        spare = self.spares.take() if slot.consecutive_failures < self.config.max_consecutive_failures else None
        if spare is not None:
            # A warm spare takes the slot at once; the crashed backend is closed meanwhile.
            self._close_meanwhile(crashed, f"close crashed {slot.instance_id}")
            slot.generation += 1
            self._replaced(slot, spare, started, spare=True)
            return
        await self.close_backend(crashed)
        # No cap: the slot retires after max_consecutive_failures anyway.
        delays = Backoff(self.config.restart_backoff_s).delays()
        while slot.consecutive_failures < self.config.max_consecutive_failures:
            slot.generation += 1
            # A new stream per generation, so a replacement does not replay its predecessor's randomness.
            backend = self._factory(self.config, slot.index + slot.generation * self.config.instances)
            failed = await start_or_close(backend, self.start_backend, self.close_backend)
            if failed is not None:
                slot.failures += 1
                slot.consecutive_failures += 1
                log.warning("restarting instance %s failed: %r", slot.instance_id, failed)
                await pause(next(delays))
                continue
            self._replaced(slot, backend, started, spare=False)
            return
        slot.state = SlotState.RETIRED
        log.error(
            "instance %s retired after %d consecutive failures; check the %s backend",
            slot.instance_id,
            slot.consecutive_failures,
            self.config.backend,
        )

    async def start_backend(self, backend: EnvBackend) -> None:
        """Start ``backend`` within ``env.op_timeout_s``."""
        await asyncio.wait_for(backend.start(), self.config.op_timeout_s)

    async def close_backend(self, backend: EnvBackend) -> None:
        """Close ``backend``; one that fails or hangs past the close timeout is dropped, logged."""
        try:
            await asyncio.wait_for(backend.close(), _CLOSE_TIMEOUT_S)
        except Exception as exc:  # a crashed env may fail to close; it is dropped either way
            log.warning("closing a %s backend failed: %r", self.config.backend, exc)
