"""Credentials, TLS and permission denials of a bus connection.

:func:`auth_options` turns a :class:`BusConfig` into nats-py connect options, reading secrets (token,
password) at call time from the environment or files, never from config values. :class:`DenialWatch`
turns the server's asynchronous ``Permissions Violation`` errors into typed
:class:`~dart.protocol.errors.PermissionDeniedError`\\ s for the operation that caused them.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections import Counter, deque
from collections.abc import Awaitable
from typing import Any, TypeVar

from opentelemetry import metrics

from dart.protocol.errors import ConfigError, PermissionDeniedError
from dart.protocol.subjects import inbox_prefix
from dart.runtime.bus.config import BusConfig

T = TypeVar("T")

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
# The server's wording, e.g.: Permissions Violation for Publish to "<prefix>.traj.<run>"
_VIOLATION = re.compile(r"Permissions Violation for (Publish|Subscription) to \"?([^\"\s']+)\"?", re.IGNORECASE)
AUTH_VIOLATION = "authorization violation"

_REFUSED = metrics.get_meter("dart.runtime.bus").create_counter(
    "dart.bus.refused", unit="{operation}", description="Operations the NATS server refused, by role and subject"
)


def auth_options(config: BusConfig) -> dict[str, Any]:
    """nats-py ``connect`` options for the config's credentials and TLS settings.

    Raises:
        ConfigError: A configured secret (token, password, creds file, TLS file) is missing or unreadable.
    """
    options: dict[str, Any] = {}
    token = config.token()
    if token is not None:
        options["token"] = token
    if config.creds_file is not None:
        if not config.creds_file.is_file():
            raise ConfigError("bus", "bus.creds_file", f"{config.creds_file} is not a readable file")
        options["user_credentials"] = str(config.creds_file)
    if config.user is not None:
        options["user"] = config.user
        password = config.password()
        if password is not None:
            options["password"] = password
        if _TOKEN.match(config.user):
            options["inbox_prefix"] = inbox_prefix(config.user)
    tls = tls_context(config)
    if tls is not None:
        options["tls"] = tls
    return options


def tls_context(config: BusConfig) -> ssl.SSLContext | None:
    """A client TLS context from ``tls_ca_file`` and the optional client certificate; None when unset.

    ``tls://`` URLs without a CA file use nats-py's default context (the system CAs).
    """
    if config.tls_ca_file is None and config.tls_cert_file is None:
        return None
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.tls_ca_file)
        if config.tls_cert_file is not None and config.tls_key_file is not None:
            context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        field = "bus.tls_ca_file" if config.tls_ca_file and "cert" not in str(exc).lower() else "bus.tls_cert_file"
        raise ConfigError("bus", field, f"cannot load the TLS files: {exc}") from exc
    return context


def is_auth_violation(exc: BaseException) -> bool:
    """Whether a nats-py error is the server refusing the connection's credentials."""
    return AUTH_VIOLATION in str(exc).lower() or type(exc).__name__ == "AuthorizationError"


class DenialWatch:
    """Permission violations the server reported on one connection, matched to the operations that caused them.

    The server answers a forbidden publish or subscription with an asynchronous ``-ERR`` and drops
    the message; the client's operation would otherwise only time out. :meth:`report` records each
    violation (from the bus's error callback); :meth:`guard` races an operation against a violation
    on its subject, so the caller gets a :class:`PermissionDeniedError` at once. nats-py lower-cases
    the server's message, so subjects are matched without regard to case.

    Attributes:
        user: The connection's user, named in errors.
        count: Violations reported so far.
        refused: Violations by ``(operation, subject)`` (subjects lower-cased), also counted in the
            ``dart.bus.refused`` metric with ``role``, ``operation`` and ``subject`` attributes.
    """

    def __init__(self, user: str | None) -> None:
        self.user = user
        self.count = 0
        self.refused: Counter[tuple[str, str]] = Counter()
        self._recent: deque[tuple[str, str]] = deque(maxlen=64)
        self._waiters: dict[tuple[str, str], list[asyncio.Future[None]]] = {}

    def report(self, message: str) -> bool:
        """Record a server error message; returns whether it was a permission violation."""
        match = _VIOLATION.search(message)
        if match is None:
            return False
        operation = "publish" if match.group(1).lower() == "publish" else "subscribe"
        key = (operation, match.group(2).lower())
        self.count += 1
        self.refused[key] += 1
        _REFUSED.add(1, {"role": self.user or "", "operation": operation, "subject": key[1]})
        self._recent.append(key)
        for waiter in self._waiters.pop(key, []):
            if not waiter.done():
                waiter.set_result(None)
        return True

    def denied(self, operation: str, subject: str) -> bool:
        """Whether a violation for ``operation`` on ``subject`` was reported recently."""
        return (operation, subject.lower()) in self._recent

    def error(self, operation: str, subject: str) -> PermissionDeniedError:
        """The typed error for a refused operation."""
        return PermissionDeniedError(self.user, operation, subject)

    async def guard(self, operation: str, subject: str, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable``, failing with :class:`PermissionDeniedError` if the server refuses ``subject``."""
        loop = asyncio.get_running_loop()
        key = (operation, subject.lower())
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.setdefault(key, []).append(waiter)
        task: asyncio.Future[T] = asyncio.ensure_future(awaitable)
        try:
            pending: set[asyncio.Future[Any]] = {task, waiter}
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                failure = task.exception()
                if failure is not None and self.denied(operation, subject):
                    raise self.error(operation, subject) from failure
                return task.result()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise self.error(operation, subject)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            waiters = self._waiters.get(key)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiters[key]
