"""The env service: a pool of env backend instances served over NATS request/reply."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import TypeVar

from dart.env.errors import EpisodeStateError, InstanceIdTakenError, LayoutError, TaskParamsError
from dart.env.interface import ENV_BACKENDS, EnvBackend
from dart.env.service.config import EnvServiceConfig
from dart.env.service.health import InstanceHealth, processes_rss_mib, recycle_reason
from dart.env.service.instance import InstanceSlot, InstanceStats, SlotState
from dart.env.service.lease import EndReason, Lease
from dart.env.service.lease_book import LeaseBook
from dart.env.service.screenshots import ScreenshotOffload
from dart.env.service.spares import SparePool, SpareStats
from dart.protocol.bus import Bus, Service
from dart.protocol.errors import NoRespondersError, RemoteError, RequestTimeoutError, ServiceError
from dart.protocol.messages import (
    CapabilitiesRequest,
    EnvCapabilities,
    ErrorCode,
    EvaluateReply,
    EvaluateRequest,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseReply,
    LeaseRequest,
    ReleaseReply,
    ReleaseRequest,
    ResetReply,
    ResetRequest,
    StepReply,
    StepRequest,
)
from dart.protocol.retry import Backoff, pause
from dart.protocol.store import ArtifactStore
from dart.protocol.telemetry import BusyTracker, Telemetry
from dart.protocol.waiting import cancel_and_wait

log = logging.getLogger("dart.env.service")

T = TypeVar("T")

_CLOSE_TIMEOUT_S = 10.0
"""How long closing a crashed or stopping backend may take before it is abandoned, seconds."""
_PROBE_TIMEOUT_S = 1.0


class EnvService:
    """Hosts ``config.instances`` env backends and serves them on the bus.

    Subjects (from ``bus.subjects``): ``env_lease(pool)`` in a queue group, so several processes
    can share a pool, ``env_capabilities(pool)`` (what the pool runs: its backend, its provider and the
    task requirements it meets, from :meth:`~dart.env.interface.EnvBackend.features`), and
    ``env_instance(pool, instance_id, op)`` for ``reset``, ``step``, ``evaluate``, ``release`` and ``heartbeat``
    of each instance.

    Clean episodes: a backend that cannot start another clean episode
    (:attr:`~dart.env.interface.EnvBackend.spent`, e.g. a VM that cannot revert) is never leased again: once
    its lease ends it is replaced like a recycled one (reason ``single_use``), and where no fresh backend
    starts, like a crashed one. A backend whose revert fails raises in ``reset``, which ends the instance.

    Lease lifecycle (see :mod:`dart.env.service.lease` and
    :class:`~dart.env.service.instance.InstanceSlot`): a lease request gets a free instance
    (least recently used first, one that last ran the hinted task preferred) or ``unavailable``
    (retryable). The holder then calls the instance with its lease id; a heartbeat or any
    successful call pushes the lease's deadline to now + ttl. Release frees the instance; a
    holder that stops heartbeating loses the lease to the reaper (or to the next call) and
    further calls get ``expired``. If the backend raises or exceeds ``op_timeout_s`` during
    reset/step/evaluate, the call is answered ``env_failed``, the lease ends (later calls on it
    get ``env_failed`` too) and the instance is replaced in the background under the same id: by a
    warm spare at once when one is ready (:class:`~dart.env.service.spares.SparePool`), else by a new
    backend, restarted with backoff until ``max_consecutive_failures`` retires the slot.

    Error codes: ``invalid_request`` (schema, or a task the backend rejects), ``not_found`` (an
    unknown or released lease), ``conflict`` (the instance is leased by someone else, the call
    does not fit the episode state, or a ``step_index`` out of sequence), ``expired``,
    ``env_failed``, ``unavailable``.

    Service lifecycle: ``created --start()--> serving --stop()--> stopped``; also an async
    context manager. The bus is the caller's and stays open.

    Example::

        async with await Bus.connect(BusConfig(url=url)) as bus:
            async with EnvService(EnvServiceConfig(pool="sim", instances=8), bus):
                await stop_event.wait()

    Args:
        config: What to host.
        bus: A connected bus.
        telemetry: Where busy/idle intervals go; None keeps them in memory (see :meth:`stats`).
        store: Where screenshots above ``config.inline_max_bytes`` are written, to be sent by
            reference (see :mod:`dart.env.service.screenshots`); None sends them inline.
    """

    def __init__(
        self,
        config: EnvServiceConfig,
        bus: Bus,
        *,
        telemetry: Telemetry | None = None,
        store: ArtifactStore | None = None,
    ) -> None:
        self.config = config
        self.screenshots = ScreenshotOffload(
            store,
            config.inline_max_bytes,
            config.screenshot_prefix,
            refresh_s=config.screenshot_refresh_s,
            setting="env.inline_max_bytes",
        )
        """Sends large screenshots by reference; its counters say how many."""
        self._bus = bus
        self._telemetry = telemetry
        self._factory = ENV_BACKENDS.get(config.backend)
        self._slots: dict[str, InstanceSlot] = {}
        self._leases = LeaseBook()
        self._services: list[Service] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._stopping = False
        self._started = False
        self._spares = SparePool(config, self._factory, start=self._start_backend, close=self._close_backend)
        self._closing: set[asyncio.Task[None]] = set()
        self._capabilities: EnvCapabilities | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every backend, then serve the pool.

        Raises:
            InstanceIdTakenError: Another process already serves one of this pool's instance ids.
            Exception: A backend failed to start (the ones started are closed again).
        """
        if self._started:
            raise RuntimeError("EnvService.start() was called twice")
        self._started = True
        await self._check_ids_free()
        for i in range(self.config.instances):
            instance_id = self.config.instance_id(i)
            tracker = (
                self._telemetry.busy_tracker("env", instance_id)
                if self._telemetry is not None
                else BusyTracker("env", instance_id)
            )
            health = InstanceHealth(self.config.recycle.latency_window)
            slot = InstanceSlot(i, instance_id, self._factory(self.config, i), tracker, health=health)
            self._slots[instance_id] = slot
        try:
            await asyncio.gather(*(self._start_backend(slot.backend) for slot in self._slots.values()))
            for slot in self._slots.values():
                await self._serve_instance(slot)
                slot.free()
            subjects = self._bus.subjects
            first = next(iter(self._slots.values())).backend
            self._capabilities = EnvCapabilities(
                pool=self.config.pool,
                backend=self.config.backend,
                provider=first.provider_name,
                features=tuple(sorted(first.features())),
            )
            self._services += [
                await self._bus.serve(
                    subjects.env_lease(self.config.pool), LeaseRequest, self._on_lease, queue="dart-env"
                ),
                await self._bus.serve(
                    subjects.env_capabilities(self.config.pool),
                    CapabilitiesRequest,
                    self._on_capabilities,
                    queue="dart-env",
                ),
            ]
        except BaseException:
            await self.stop()
            raise
        self._reaper = asyncio.create_task(self._reap_forever(), name=f"env reaper {self.config.pool}")
        self._spares.start()
        log.info("env pool %s serving %d %s instances", self.config.pool, len(self._slots), self.config.backend)

    async def stop(self) -> None:
        """Stop serving, end every lease and close every backend (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        # The lease subject goes first so no new holder arrives while instances shut down.
        for service in self._services:
            await service.stop()
        background = [*self._tasks, *([self._reaper] if self._reaper is not None else [])]
        await asyncio.gather(cancel_and_wait(background), self._spares.stop(), return_exceptions=True)
        # Crashed backends being closed are waited for, not cancelled: a half-closed browser or
        # desktop would outlive the service.
        await asyncio.gather(*self._closing, return_exceptions=True)
        for slot in self._slots.values():
            if slot.lease is not None:
                self._leases.end(slot, EndReason.STOPPED)
            slot.state = SlotState.STOPPED
        await asyncio.gather(
            *(self._close_backend(slot.backend) for slot in self._slots.values()), self._spares.close()
        )
        self._emit_stats()
        log.info("env pool %s stopped", self.config.pool)

    async def __aenter__(self) -> EnvService:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # --- inspection -----------------------------------------------------------------------------
    @property
    def instance_ids(self) -> list[str]:
        """Ids of the hosted instances, in slot order."""
        return list(self._slots)

    def backend(self, instance_id: str) -> EnvBackend:
        """The backend currently behind ``instance_id`` (for tests and tools, e.g. its oracle).

        Raises:
            KeyError: No such instance here.
        """
        return self._slots[instance_id].backend

    def stats(self) -> dict[str, InstanceStats]:
        """Per-instance counters and busy/idle seconds, by instance id."""
        return {instance_id: slot.stats() for instance_id, slot in self._slots.items()}

    def spare_stats(self) -> SpareStats:
        """The warm-spare pool's counters."""
        return self._spares.stats()

    def _emit_stats(self) -> None:
        """Write every instance's counters to telemetry (``env.instance_stats`` events)."""
        if self._telemetry is None:
            return
        for stats in self.stats().values():
            self._telemetry.event(
                "env.instance_stats",
                instance_id=stats.instance_id,
                backend=self.config.backend,
                state=stats.state.value,
                busy_s=stats.busy_s,
                idle_s=stats.idle_s,
                resets=stats.resets,
                steps=stats.steps,
                evaluations=stats.evaluations,
                failures=stats.failures,
                restarts=stats.restarts,
                recycles=stats.recycles,
                episodes=stats.episodes,
                rss_mib=round(stats.rss_mib, 1),
                step_latency_ratio=round(stats.step_latency_ratio, 3),
                leases_granted=stats.leases_granted,
                leases_released=stats.leases_released,
                leases_expired=stats.leases_expired,
            )

    @property
    def capabilities(self) -> EnvCapabilities | None:
        """What the pool runs, as answered on ``env_capabilities(pool)`` (None before :meth:`start`)."""
        return self._capabilities

    # --- capability and lease subjects ----------------------------------------------------------
    async def _on_capabilities(self, request: CapabilitiesRequest) -> EnvCapabilities:
        assert self._capabilities is not None  # served only once set
        return self._capabilities

    async def _on_lease(self, request: LeaseRequest) -> LeaseReply:
        for slot in self._slots.values():
            if slot.state == SlotState.FREE and slot.backend.spent:
                # Freed by an expiry: a backend that cannot revert is replaced before anyone gets it.
                self._recycle_if_due(slot)
        free = [slot for slot in self._slots.values() if slot.state == SlotState.FREE]
        if self._stopping or not free:
            raise ServiceError(
                ErrorCode.UNAVAILABLE,
                f"no free instance in pool {self.config.pool!r} here; retry shortly",
                {"pool": self.config.pool, "instances": len(self._slots)},
                retryable=True,
            )
        # Least recently used first spreads wear (and busy time) evenly; a task hint wins over it
        # because a backend that last ran the task may reset to it faster.
        slot = min(free, key=lambda s: (s.last_task_id != request.task_id or request.task_id is None, s.free_since))
        ttl = min(request.ttl_s, self.config.max_lease_ttl_s)
        now = time.monotonic()
        lease = Lease(uuid.uuid4().hex, request.holder, ttl, now + ttl, now)
        slot.grant(lease)
        width, height = slot.backend.screen_size
        return LeaseReply(
            lease_id=lease.lease_id,
            instance_id=slot.instance_id,
            backend=self.config.backend,
            expires_at=lease.expires_at,
            heartbeat_interval_s=min(self.config.heartbeat_interval_s, ttl / 3),
            screen_width=width,
            screen_height=height,
        )

    # --- instance subjects ----------------------------------------------------------------------
    async def _serve_instance(self, slot: InstanceSlot) -> None:
        subjects = self._bus.subjects
        iid = slot.instance_id

        async def reset(request: ResetRequest) -> ResetReply:
            with _counted(slot, request.lease_id):
                return await self._on_reset(slot, request)

        async def step(request: StepRequest) -> StepReply:
            with _counted(slot, request.lease_id):
                return await self._on_step(slot, request)

        async def evaluate(request: EvaluateRequest) -> EvaluateReply:
            with _counted(slot, request.lease_id):
                return await self._on_evaluate(slot, request)

        async def release(request: ReleaseRequest) -> ReleaseReply:
            return await self._on_release(slot, request)

        async def heartbeat(request: HeartbeatRequest) -> HeartbeatReply:
            return await self._on_heartbeat(slot, request)

        self._services += [
            await self._bus.serve(subjects.env_instance(self.config.pool, iid, "reset"), ResetRequest, reset),
            await self._bus.serve(subjects.env_instance(self.config.pool, iid, "step"), StepRequest, step),
            await self._bus.serve(subjects.env_instance(self.config.pool, iid, "evaluate"), EvaluateRequest, evaluate),
            await self._bus.serve(subjects.env_instance(self.config.pool, iid, "release"), ReleaseRequest, release),
            await self._bus.serve(
                subjects.env_instance(self.config.pool, iid, "heartbeat"), HeartbeatRequest, heartbeat
            ),
        ]

    async def _on_reset(self, slot: InstanceSlot, request: ResetRequest) -> ResetReply:
        async with slot.lock:
            self._leases.authorize(slot, request.lease_id)
            started = time.monotonic()
            observation, instruction = await self._call(slot, "reset", lambda b: b.reset(request.task, request.seed))
            observation = await self.screenshots.observation(observation)
            slot.resets += 1
            slot.health.episodes += 1
            slot.last_task_id = request.task.task_id
            slot.next_step_index = 0
            slot.last_step = None
            return ResetReply(
                observation=observation, instruction=instruction, env_latency_s=time.monotonic() - started
            )

    async def _on_step(self, slot: InstanceSlot, request: StepRequest) -> StepReply:
        async with slot.lock:
            self._leases.authorize(slot, request.lease_id)
            if slot.last_step is not None and request.step_index == slot.next_step_index - 1:
                # The holder retried a step whose reply it lost: answer again, do not act twice.
                return slot.last_step
            if request.step_index != slot.next_step_index:
                raise ServiceError(
                    ErrorCode.CONFLICT,
                    f"step_index {request.step_index} is out of sequence on {slot.instance_id}: "
                    f"expected {slot.next_step_index} (0 right after a reset)",
                    {"expected": slot.next_step_index, "got": request.step_index},
                )
            started = time.monotonic()
            observation, done, info = await self._call(slot, "step", lambda b: b.step(request.action))
            observation = await self.screenshots.observation(observation)
            slot.steps += 1
            slot.next_step_index += 1
            latency = time.monotonic() - started
            slot.health.step(latency)
            slot.last_step = StepReply(observation=observation, done=done, env_latency_s=latency, info=info)
            return slot.last_step

    async def _on_evaluate(self, slot: InstanceSlot, request: EvaluateRequest) -> EvaluateReply:
        async with slot.lock:
            self._leases.authorize(slot, request.lease_id)
            started = time.monotonic()
            reward, success, details = await self._call(slot, "evaluate", lambda b: b.evaluate())
            slot.evaluations += 1
            return EvaluateReply(
                reward=reward, success=success, env_latency_s=time.monotonic() - started, details=details
            )

    async def _on_release(self, slot: InstanceSlot, request: ReleaseRequest) -> ReleaseReply:
        async with slot.lock:
            # Releasing a lease that has already ended is not an error: the instance is back anyway.
            lease = self._leases.authorize(slot, request.lease_id, ended_ok=True)
            if lease is None:
                return ReleaseReply(released=False)
            self._leases.end(slot, EndReason.RELEASED)
            self._recycle_if_due(slot)
            return ReleaseReply(released=True)

    async def _on_heartbeat(self, slot: InstanceSlot, request: HeartbeatRequest) -> HeartbeatReply:
        # No lock: a heartbeat must get through while a long step holds the instance.
        lease = self._leases.authorize(slot, request.lease_id)
        assert lease is not None
        lease.touch()
        return HeartbeatReply(
            expires_at=lease.expires_at, calls_received=lease.calls_received, calls_answered=lease.calls_answered
        )

    # --- leases ---------------------------------------------------------------------------------
    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            now = time.monotonic()
            for slot in self._slots.values():
                lease = slot.lease
                # A slot whose lock is held has a call in flight or queued: its holder is alive.
                if lease is not None and lease.expired(now) and not slot.lock.locked():
                    self._leases.end(slot, EndReason.EXPIRED)
                    self._recycle_if_due(slot)

    # --- backend calls and crash recovery -------------------------------------------------------
    async def _call(self, slot: InstanceSlot, op: str, call: Callable[[EnvBackend], Awaitable[T]]) -> T:
        """Run one backend operation with the slot's lock held; map its failures to error replies."""
        slot.running_op = op
        try:
            with slot.tracker.busy(op):
                result = await asyncio.wait_for(call(slot.backend), self.config.op_timeout_s)
        except (TaskParamsError, LayoutError) as exc:
            raise ServiceError(ErrorCode.INVALID_REQUEST, str(exc), {"instance_id": slot.instance_id}) from exc
        except EpisodeStateError as exc:
            raise ServiceError(
                ErrorCode.CONFLICT, str(exc), {"instance_id": slot.instance_id, "state": exc.state}
            ) from exc
        except Exception as exc:
            # Anything else means the env is in an unknown state: never hand it to anyone again.
            detail = f"{op} timed out after {self.config.op_timeout_s:g}s" if isinstance(exc, TimeoutError) else None
            self._fail(slot, op, exc)
            raise ServiceError(
                ErrorCode.ENV_FAILED,
                f"instance {slot.instance_id} failed during {op}: {detail or f'{type(exc).__name__}: {exc}'}; "
                "report the episode as env_failed and lease again",
                {"instance_id": slot.instance_id, "op": op},
            ) from exc
        finally:
            slot.running_op = None
        if op == "evaluate":
            # Only a whole episode proves the backend sound: a backend that resets fine and then
            # crashes mid-episode every time must still trip the breaker.
            slot.consecutive_failures = 0
        if slot.lease is not None:
            slot.lease.touch()
        return result

    def _fail(self, slot: InstanceSlot, op: str, exc: BaseException) -> None:
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

    # --- recycling ------------------------------------------------------------------------------
    def _recycle_if_due(self, slot: InstanceSlot) -> None:
        """Measure a just-freed instance; past a recycle limit, or spent (it cannot start another clean
        episode), swap its backend for a fresh one."""
        slot.rss_mib = processes_rss_mib(slot.backend.process_ids())
        spent = slot.backend.spent
        reason = "single_use" if spent else recycle_reason(slot.health, slot.rss_mib, self.config.recycle)
        if reason is None or self._stopping or slot.state != SlotState.FREE:
            return
        slot.state = SlotState.REPLACING  # not leasable until the fresh backend is in
        log.info("recycling instance %s (%s)", slot.instance_id, reason)
        self._background(self._recycle(slot, reason), f"recycle {slot.instance_id}")

    async def _recycle(self, slot: InstanceSlot, reason: str) -> None:
        started = time.monotonic()
        worn, health, rss_mib = slot.backend, slot.health, slot.rss_mib
        fresh = self._spares.take()
        from_spare = fresh is not None
        if fresh is None:
            fresh = self._factory(self.config, slot.index + (slot.generation + 1) * self.config.instances)
            try:
                await self._start_backend(fresh)
            except asyncio.CancelledError:
                await self._close_backend(fresh)
                raise
            except Exception as exc:
                await self._close_backend(fresh)
                if worn.spent:
                    # The old backend cannot give a clean episode: the slot is restarted like a crashed one.
                    self._fail(slot, "recycle", exc)
                    return
                # The worn backend still works: it serves on, and the next release tries again.
                log.warning("starting a fresh backend for %s failed: %r; keeping the old one", slot.instance_id, exc)
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
        closing = asyncio.create_task(self._close_backend(backend), name=name)
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
        spare = self._spares.take() if slot.consecutive_failures < self.config.max_consecutive_failures else None
        if spare is not None:
            # A warm spare takes the slot at once; the crashed backend is closed meanwhile.
            self._close_meanwhile(crashed, f"close crashed {slot.instance_id}")
            slot.generation += 1
            self._replaced(slot, spare, started, spare=True)
            return
        await self._close_backend(crashed)
        # No cap: the slot retires after max_consecutive_failures anyway.
        delays = Backoff(self.config.restart_backoff_s).delays()
        while slot.consecutive_failures < self.config.max_consecutive_failures:
            slot.generation += 1
            # A new stream per generation, so a replacement does not replay its predecessor's randomness.
            backend = self._factory(self.config, slot.index + slot.generation * self.config.instances)
            try:
                await self._start_backend(backend)
            except asyncio.CancelledError:
                await self._close_backend(backend)  # the service is stopping; do not leak a half-started env
                raise
            except Exception as exc:
                slot.failures += 1
                slot.consecutive_failures += 1
                log.warning("restarting instance %s failed: %r", slot.instance_id, exc)
                await self._close_backend(backend)
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

    async def _start_backend(self, backend: EnvBackend) -> None:
        await asyncio.wait_for(backend.start(), self.config.op_timeout_s)

    async def _close_backend(self, backend: EnvBackend) -> None:
        try:
            await asyncio.wait_for(backend.close(), _CLOSE_TIMEOUT_S)
        except Exception as exc:  # a crashed env may fail to close; it is dropped either way
            log.warning("closing a %s backend failed: %r", self.config.backend, exc)

    async def _check_ids_free(self) -> None:
        """Refuse to serve an instance id that another process already serves."""

        async def taken(instance_id: str) -> bool:
            subject = self._bus.subjects.env_instance(self.config.pool, instance_id, "heartbeat")
            try:
                await self._bus.request(
                    subject, HeartbeatRequest(lease_id="probe"), HeartbeatReply, timeout=_PROBE_TIMEOUT_S
                )
            except NoRespondersError:
                return False
            except (RemoteError, RequestTimeoutError):
                pass  # an error reply, or a subscriber too busy to answer: either way, someone is there
            return True

        ids = [self.config.instance_id(i) for i in range(self.config.instances)]
        for instance_id, is_taken in zip(ids, await asyncio.gather(*map(taken, ids)), strict=True):
            if is_taken:
                raise InstanceIdTakenError(instance_id)


@contextlib.contextmanager
def _counted(slot: InstanceSlot, lease_id: str) -> Iterator[None]:
    """Count a call on the lease it names: received on entry, answered on the way out.

    Entered before the handler's first await and left just before the bus sends the reply, so a heartbeat
    answered later never reports a call that has not arrived, nor one answered whose reply is not on its way.
    """
    lease = slot.lease if slot.lease is not None and slot.lease.lease_id == lease_id else None
    if lease is not None:
        lease.calls_received += 1
    try:
        yield
    finally:
        if lease is not None:
            lease.calls_answered += 1
