"""Supervision of a run's processes: a service (or embedded server) that dies is restarted with backoff.

Every service is written to survive its own restart: the trainer resumes from its newest
checkpoint and gets the batches it had not acknowledged again (durable consumer), dart-data reloads
task statistics and the pool from its index and ingests the trajectories it had not acknowledged
(idempotent by trajectory id), the rollout service reloads the newest published version and its
unacknowledged work items are redelivered, the env service registers fresh instances (the runners'
leases on the old ones fail, and those trajectories end FAILED with the reason). So a death costs
work in flight, never data already acknowledged.

Per service::

    running -> died (exit code recorded in ``restarts``)
      -> waiting ``restart_backoff_s * 2**(deaths - 1)`` seconds (at most 60)
      -> running again (same command, config and environment)
      ...
      -> given up at death number ``max_restarts + 1``: :meth:`ServiceSupervisor.check` returns why,
         and the run fails as an unsupervised one would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from dart.cli.cluster.launch import ServiceProcess
from dart.runtime.retry import Backoff

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0
"""Longest wait before a restart, seconds."""


class Server(Protocol):
    """An embedded server the supervisor can restart in place (e.g. :class:`dart.embedded.nats.EmbeddedNats`)."""

    @property
    def pid(self) -> int | None: ...

    def poll(self) -> int | None:
        """The exit code once it died; None while it runs."""

    def restart(self) -> object:
        """Start it again, the same way."""


@dataclass
class Restart:
    """One death of a service and what was done about it.

    Attributes:
        service: The service's (or server's) name.
        exit_code: Its exit code (negative: killed by that signal).
        died_after_s: Seconds from supervision start to when the death was seen.
        restarted_after_s: Seconds from supervision start to the respawn; None when given up (or not yet).
    """

    service: str
    exit_code: int
    died_after_s: float
    restarted_after_s: float | None = None


class ServiceSupervisor:
    """Watches service processes and restarts the ones that die.

    Example::

        supervisor = ServiceSupervisor(procs, lambda name: spawn(name, ...), max_restarts=3, backoff_s=2.0)
        while running:
            if (why := supervisor.check()) is not None:
                fail(why)
            await asyncio.sleep(1.0)

    ``procs`` is shared with the caller: a restart replaces the entry, so the caller always stops the
    live process.
    """

    def __init__(
        self,
        procs: dict[str, ServiceProcess],
        respawn: Callable[[str], ServiceProcess],
        *,
        max_restarts: int,
        backoff_s: float,
        servers: dict[str, Server] | None = None,
        notify: Callable[[str], None] = log.warning,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Supervise ``procs``.

        Args:
            procs: Service name -> its running process (updated in place on restart).
            respawn: Starts a service again by name.
            max_restarts: Restarts allowed per service; 0 gives up at the first death.
            backoff_s: Wait before the first restart of a service, seconds; doubled per death.
            servers: Embedded servers to keep alive too, by name (restarted in place, same limits).
            notify: Told of every death and restart, in words (``dart run`` prints them).
            clock: Monotonic seconds.
        """
        self._procs = procs
        self._respawn = respawn
        self._servers = servers or {}
        self._max = max_restarts
        self._backoff = Backoff(backoff_s, max_s=MAX_BACKOFF_S)
        self._notify = notify
        self._clock = clock
        self._started = clock()
        self._due: dict[str, float] = {}
        self._given_up: set[str] = set()
        self.restarts: list[Restart] = []

    def deaths(self, service: str) -> int:
        """How often ``service`` died so far."""
        return sum(1 for r in self.restarts if r.service == service)

    def check(self) -> str | None:
        """Record deaths, restart the processes whose backoff is over; why the run must fail, if it must."""
        now = self._clock()
        for name in [*self._procs, *self._servers]:
            if name in self._due or name in self._given_up:
                continue
            code = self._procs[name].poll() if name in self._procs else self._servers[name].poll()
            if code is None:
                continue
            self.restarts.append(Restart(name, int(code), round(now - self._started, 2)))
            deaths = self.deaths(name)
            if deaths > self._max:
                self._given_up.add(name)
                return f"{name} exited with code {code} and was restarted {self._max} time(s) already: giving up"
            wait = self._backoff.delay_s(deaths)
            self._notify(f"{name} exited with code {code}; restarting it in {wait:.1f}s")
            self._due[name] = now + wait
        for name, due in list(self._due.items()):
            if now >= due:
                del self._due[name]
                pid = self._start_again(name)
                last = next(r for r in reversed(self.restarts) if r.service == name)
                last.restarted_after_s = round(self._clock() - self._started, 2)
                self._notify(f"{name} restarted (pid {pid})")
        return None

    def _start_again(self, name: str) -> int | None:
        if name in self._procs:
            self._procs[name] = self._respawn(name)
            return self._procs[name].pid
        server = self._servers[name]
        server.restart()
        return server.pid

    def report(self) -> list[dict[str, Any]]:
        """The restarts as JSON-ready dicts (the summary's ``service_restarts``)."""
        return [asdict(r) for r in self.restarts]
