"""A lease-holding client of the env service, as a trajectory runner uses it.

Lease lifecycle (client side)::

    idle --lease()--> leased (background heartbeat) --reset()--> episode: step(0), step(1), ...
         --evaluate()--> evaluated --release()--> idle
    leased/episode --env_failed | expired | not_found | no reply--> lost (EnvFailed) --release()--> idle

``lease()`` retries while the pool answers ``unavailable`` (retryable) with exponential backoff up
to ``lease_timeout_s``. Step indices restart at 0 after every reset, as the service requires.
``release()`` never raises, so it is safe in ``finally``.

The heartbeat also watches the instance while a call is in flight: when the service says the lease is
over, or nobody has served the instance for ``env_gone_after_s`` (its env service died; a restarted one
does not know the lease), the call in flight ends at once with :class:`EnvFailed` instead of waiting
out ``env_request_timeout_s``.

And it finds calls the bus lost. Core NATS delivers a request at most once: a broker node that dies
with a request or its reply on it loses it, and the caller would wait ``env_request_timeout_s``. Every
heartbeat reply says how many of the lease's calls the service has received and answered. Once a call
has waited ``env_call_check_s``, heartbeats come that often; one that finds the call never received (a
heartbeat sent after it got there first), or answered with no reply here on two checks in a row, sends
the call again (at most ``env_call_resends`` times, then the lease counts as lost). Sending again is
safe: a step carries its index, and the service answers a repeated index with its first reply; a reset
or an evaluate whose reply never arrived was not seen by the runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar

from pydantic import BaseModel

from dart.protocol.errors import NoRespondersError, RemoteError, RequestTimeoutError
from dart.protocol.messages import (
    Action,
    ErrorCode,
    EvaluateReply,
    EvaluateRequest,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseReply,
    LeaseRequest,
    Message,
    ReleaseReply,
    ReleaseRequest,
    ResetReply,
    ResetRequest,
    StepReply,
    StepRequest,
    TaskSpec,
)
from dart.protocol.subjects import EnvOp
from dart.rollout.errors import EnvFailed, ForkRefused
from dart.rollout.service.config import RunnerConfig
from dart.runtime.bus import Bus
from dart.runtime.retry import Backoff, retry

log = logging.getLogger("dart.rollout.env_client")

R = TypeVar("R", bound=BaseModel)

# Codes that mean "this lease is over": the episode cannot go on on this instance.
LOST_LEASE_CODES = frozenset({ErrorCode.ENV_FAILED, ErrorCode.EXPIRED, ErrorCode.NOT_FOUND})


def _pool_busy(exc: BaseException) -> bool:
    """Whether a lease request may succeed later: the pool is full, or restarting (nobody answers)."""
    if isinstance(exc, RemoteError):
        return exc.retryable or exc.code == ErrorCode.UNAVAILABLE
    return isinstance(exc, RequestTimeoutError | NoRespondersError)


class EnvClient:
    """Holds at most one env lease and drives one episode at a time on it.

    Example::

        async with EnvClient(bus, "runner-0", RunnerConfig(pool="sim")) as env:
            await env.lease(task.task_id)
            first = await env.reset(task)
            reply = await env.step(action)
            score = await env.evaluate()
        # released on exit

    Args:
        bus: A connected bus.
        holder: Lease holder name (the runner id), for the service's diagnostics.
        config: Pool, lease ttl, backoff and timeouts.
    """

    def __init__(self, bus: Bus, holder: str, config: RunnerConfig) -> None:
        self._bus = bus
        self._holder = holder
        self._config = config
        self._lease: LeaseReply | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._lost: EnvFailed | None = None
        self._lost_event = asyncio.Event()
        self._next_step = 0
        self._calls_sent = 0  # reset/step/evaluate requests sent on this lease, resends included
        self._in_flight: asyncio.Future[Any] | None = None  # the call waiting for its reply
        self._in_flight_sent = 0.0  # monotonic time it was sent
        self._reply_missing_since: float | None = None  # a heartbeat found it answered, its reply not here
        self._send_again = asyncio.Event()

    @property
    def lease_reply(self) -> LeaseReply | None:
        """The current lease, or None when idle."""
        return self._lease

    @property
    def instance_id(self) -> str | None:
        """The leased instance, or None when idle."""
        return None if self._lease is None else self._lease.instance_id

    async def lease(self, task_id: str | None = None) -> LeaseReply:
        """Lease an instance, retrying with backoff while the pool is full.

        Raises:
            EnvFailed: No instance within ``lease_timeout_s`` (code ``unavailable``): the pool stayed
                full, or nobody served it.
            RemoteError: Any other refusal (e.g. an invalid request).
        """
        if self._lease is not None:
            raise RuntimeError(f"{self._holder} already holds lease {self._lease.lease_id}; release it first")
        subject = self._bus.subjects.env_lease(self._config.pool)
        request = LeaseRequest(holder=self._holder, ttl_s=self._config.lease_ttl_s, task_id=task_id)
        pool = self._config.pool
        try:
            reply = await retry(
                lambda: self._bus.request(subject, request, LeaseReply),
                backoff=Backoff(self._config.lease_backoff_s, max_s=self._config.lease_backoff_max_s),
                timeout_s=self._config.lease_timeout_s,
                retryable=_pool_busy,
                what=f"leasing from pool {pool!r}",
                logger=log,
                log_level=logging.DEBUG,  # a full pool is routine: runners outnumber instances
            )
        except (RemoteError, RequestTimeoutError, NoRespondersError) as exc:
            if not _pool_busy(exc):
                raise
            detail = exc.message if isinstance(exc, RemoteError) else str(exc)
            raise EnvFailed(None, ErrorCode.UNAVAILABLE, f"no instance of pool {pool!r}: {detail}") from exc
        self._lease, self._lost, self._next_step = reply, None, 0
        self._calls_sent = 0
        self._lost_event = asyncio.Event()
        self._heartbeat = asyncio.create_task(self._heartbeat_forever(reply), name=f"heartbeat-{reply.lease_id}")
        return reply

    async def reset(
        self,
        task: TaskSpec,
        seed: int | None = None,
        *,
        replay: Sequence[Action] = (),
        expect_sha256: Sequence[str | None] = (),
    ) -> ResetReply:
        """Reset the instance to ``task`` (with ``replay``: fork an episode of it, the screens checked against
        ``expect_sha256``); step numbering restarts at 0.

        Raises:
            ForkRefused: The pool would not fork (the lease is still held: a plain reset may follow).
            EnvFailed: The lease is lost, the instance failed, or the env refused to set the task up (its
                params, a setup step): the episode cannot start, which is the env's side, not the policy's.
        """
        lease = self._require()
        request = ResetRequest(
            lease_id=lease.lease_id, task=task, seed=seed, replay=list(replay), expect_sha256=list(expect_sha256)
        )
        try:
            reply = await self._call("reset", request, ResetReply)
        except RemoteError as exc:
            reason = exc.details.get("reason")
            if exc.code == ErrorCode.CONFLICT and isinstance(reason, str) and reason.startswith("fork_"):
                raise ForkRefused(reason, exc.message) from exc
            detail = f"the env could not set task {task.task_id!r} up: {exc.message}"
            raise EnvFailed(lease.instance_id, exc.code, detail) from exc
        self._next_step = 0
        return reply

    async def step(self, action: Action) -> StepReply:
        """Execute ``action`` as the next step of the episode.

        Raises:
            EnvFailed: The lease is lost or the instance failed.
        """
        lease = self._require()
        request = StepRequest(lease_id=lease.lease_id, action=action, step_index=self._next_step)
        reply = await self._call("step", request, StepReply)
        self._next_step += 1
        return reply

    async def evaluate(self) -> EvaluateReply:
        """Score the episode.

        Raises:
            EnvFailed: The lease is lost or the instance failed.
        """
        lease = self._require()
        return await self._call("evaluate", EvaluateRequest(lease_id=lease.lease_id), EvaluateReply)

    async def release(self, reason: str = "") -> bool:
        """Give the instance back; returns whether the service still knew the lease. Never raises."""
        lease, self._lease = self._lease, None
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if lease is None:
            return False
        subject = self._bus.subjects.env_instance(self._config.pool, lease.instance_id, "release")
        try:
            reply = await self._bus.request(
                subject, ReleaseRequest(lease_id=lease.lease_id, reason=reason), ReleaseReply
            )
            return reply.released
        except Exception as exc:  # the lease then expires on the service side; nothing leaks
            log.warning("releasing %s on %s failed: %s", lease.lease_id, lease.instance_id, exc)
            return False

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.release(reason=type(exc).__name__ if exc is not None else "")

    # --- internals ------------------------------------------------------------------------------
    def _require(self) -> LeaseReply:
        if self._lost is not None:
            raise self._lost
        if self._lease is None:
            raise RuntimeError("no lease held; call lease() first")
        return self._lease

    def _mark_lost(self, lost: EnvFailed) -> None:
        """Remember why the lease is over, and end the call in flight (if any) with it."""
        self._lost = lost
        self._lost_event.set()

    async def _call(self, op: EnvOp, request: Message, reply_type: type[R]) -> R:
        lease = self._require()
        subject = self._bus.subjects.env_instance(self._config.pool, lease.instance_id, op)
        resends = 0
        while True:
            call = await self._send(subject, request, reply_type)
            if not call.cancelled():
                break
            if self._lost is not None:
                # The heartbeat found the lease over (or the instance unserved) while the call was in flight.
                raise self._lost
            if resends == self._config.env_call_resends:
                failure = EnvFailed(
                    lease.instance_id,
                    "lost_on_bus",
                    f"{op} on {lease.instance_id} was lost on the bus {resends + 1} times",
                )
                self._mark_lost(failure)
                raise failure
            resends += 1
        try:
            return call.result()
        except RemoteError as exc:
            if exc.code in LOST_LEASE_CODES:
                failure = EnvFailed(lease.instance_id, exc.code, exc.message)
                self._mark_lost(failure)
                raise failure from exc
            raise
        except RequestTimeoutError as exc:
            failure = EnvFailed(lease.instance_id, "timeout", str(exc))
            self._mark_lost(failure)
            raise failure from exc
        except NoRespondersError as exc:
            failure = EnvFailed(lease.instance_id, "no_responders", str(exc))
            self._mark_lost(failure)
            raise failure from exc

    async def _send(self, subject: str, request: Message, reply_type: type[R]) -> asyncio.Task[R]:
        """Send one call and wait for its reply, the lease's loss, or the heartbeat's word that the bus
        lost it; returns the call's task, cancelled in the last two cases."""
        self._calls_sent += 1
        self._send_again.clear()
        self._reply_missing_since = None
        call = asyncio.ensure_future(
            self._bus.request(subject, request, reply_type, timeout=self._config.env_request_timeout_s)
        )
        self._in_flight, self._in_flight_sent = call, time.monotonic()
        lost = asyncio.ensure_future(self._lost_event.wait())
        again = asyncio.ensure_future(self._send_again.wait())
        try:
            await asyncio.wait({call, lost, again}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._in_flight = None
            lost.cancel()
            again.cancel()
            if not call.done():
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call
        return call

    def _check_call(self, reply: HeartbeatReply, beat_sent: float) -> None:
        """Compare a heartbeat's counts with the call in flight; ask ``_send`` to send it again when the
        bus lost it."""
        call = self._in_flight
        if call is None or call.done() or reply.calls_received is None or reply.calls_answered is None:
            return
        if beat_sent - self._in_flight_sent < self._config.env_call_check_s:
            return  # too fresh to judge
        what = f"call {self._calls_sent} on {self.instance_id}"
        if reply.calls_received < self._calls_sent:
            # The heartbeat was sent after the call on the same connection, and got there first.
            log.warning("%s never reached the env service (lost on the bus): sending it again", what)
            self._calls_sent = reply.calls_received
            self._send_again.set()
        elif reply.calls_answered >= self._calls_sent:
            # Its reply went out before this heartbeat's; give a reply on its way a check's time to land.
            now = time.monotonic()
            if self._reply_missing_since is None:
                self._reply_missing_since = now
            elif now - self._reply_missing_since >= self._config.env_call_check_s:
                log.warning("the reply to %s was lost on the bus: sending the call again", what)
                self._send_again.set()
        else:
            self._reply_missing_since = None  # received, still running

    def _call_overdue(self, now: float) -> bool:
        call = self._in_flight
        return call is not None and not call.done() and now - self._in_flight_sent >= self._config.env_call_check_s

    async def _heartbeat_forever(self, lease: LeaseReply) -> None:
        subject = self._bus.subjects.env_instance(self._config.pool, lease.instance_id, "heartbeat")
        unserved_since: float | None = None  # first heartbeat that found nobody serving the instance
        last_beat = time.monotonic()
        while True:
            # Wake often enough to check a call that has waited env_call_check_s; beat when it is time.
            pause = min(lease.heartbeat_interval_s, self._config.env_call_check_s)
            if unserved_since is not None:
                pause = min(pause, self._config.env_gone_probe_s)
            await asyncio.sleep(pause)
            now = time.monotonic()
            due = now - last_beat >= lease.heartbeat_interval_s
            if not (due or unserved_since is not None or self._call_overdue(now)):
                continue
            last_beat = now
            try:
                reply = await self._bus.request(subject, HeartbeatRequest(lease_id=lease.lease_id), HeartbeatReply)
                unserved_since = None
                self._check_call(reply, beat_sent=now)
            except RemoteError as exc:
                if exc.code in LOST_LEASE_CODES:
                    self._mark_lost(EnvFailed(lease.instance_id, exc.code, exc.message))
                    return
                log.warning("heartbeat on %s refused: %s", lease.instance_id, exc)
            except NoRespondersError:
                # Nobody subscribes to the instance: its env service is gone (leases live in its memory,
                # so a restarted one will not know this lease either). A short grace covers a service
                # that is re-subscribing after a broker restart; then the lease is over.
                now = time.monotonic()
                unserved_since = now if unserved_since is None else unserved_since
                if now - unserved_since >= self._config.env_gone_after_s:
                    self._mark_lost(
                        EnvFailed(
                            lease.instance_id,
                            "no_responders",
                            f"nobody has served {lease.instance_id} for {now - unserved_since:.1f}s: "
                            "its env service is gone",
                        )
                    )
                    return
            except Exception as exc:  # a timeout or a broker outage: the next heartbeat (or call) decides
                log.warning("heartbeat on %s got no reply: %s", lease.instance_id, exc)
