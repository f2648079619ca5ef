"""Opening the NATS connection a :class:`~dart.runtime.bus.client.Bus` wraps.

Connection lifecycle (what :func:`open_connection` and :class:`ConnectionWatch` see)::

    connecting --server answers--> connected --server lost--> reconnecting --back--> connected
        |  (retried every reconnect_wait_s)          (disconnects / reconnects counted and logged)
        +--auth violation--> refused (BusAuthError at once: the same credentials cannot succeed)
        +--connect_timeout_s passes--> failed (BusConnectionError naming the last error)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient

from dart.protocol.errors import BusAuthError, BusConnectionError, ConfigError
from dart.runtime.bus.auth import DenialWatch, auth_options, is_auth_violation
from dart.runtime.bus.config import BusConfig
from dart.runtime.bus.stats import BusStats

log = logging.getLogger("dart.runtime.bus")


class ConnectionWatch:
    """The NATS client's callbacks for one connection: errors, disconnects and reconnects, logged and counted.

    Until :attr:`connected` is set, an error is only remembered (the last one names the cause of a
    failed first connect), and an authorization violation sets :attr:`refused`.

    Args:
        nc: The client whose callbacks these are.
        config: Its config (servers and user, for the log).
    """

    def __init__(self, nc: NatsClient, config: BusConfig) -> None:
        self._nc = nc
        self._servers = config.servers
        self._user = config.user
        self.stats = BusStats()
        """Disconnects and reconnects so far."""
        self.denials = DenialWatch(config.user)
        """Permission denials the server reported."""
        self.last_error: BaseException | None = None
        """The latest error the client reported."""
        self.connected = asyncio.Event()
        """Set once the first connection is up (and checked)."""
        self.refused = asyncio.Event()
        """Set when the server refused the credentials before the first connection."""

    def callbacks(self) -> dict[str, Any]:
        """The callback options of ``nats.connect``."""
        return {
            "error_cb": self._on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
            "closed_cb": self._on_closed,
        }

    async def _on_error(self, exc: Exception) -> None:
        self.last_error = exc
        if self.denials.report(str(exc)):
            log.warning("NATS refused %s: %s", self._user or "this client", exc)
        elif not self.connected.is_set() and is_auth_violation(exc):
            self.refused.set()  # retrying the same credentials cannot succeed
        elif self.connected.is_set():
            log.warning("NATS error on %s: %s", self._servers, exc)

    async def _on_disconnected(self) -> None:
        # On close() nats-py reports a disconnect too; only a lost connection is news.
        if self.connected.is_set() and not self._nc.is_closed:
            self.stats.disconnects += 1
            log.warning("disconnected from NATS (%s); reconnecting", ", ".join(self._servers))

    async def _on_reconnected(self) -> None:
        self.stats.reconnects += 1
        url = self._nc.connected_url
        log.info("reconnected to NATS at %s", url.geturl() if url else self._servers)

    async def _on_closed(self) -> None:
        if self.connected.is_set():
            log.info("NATS connection to %s closed", ", ".join(self._servers))


async def open_connection(config: BusConfig) -> tuple[NatsClient, ConnectionWatch]:
    """A connected NATS client for ``config`` and the watch on its connection.

    Raises:
        BusAuthError: The server refused the credentials.
        BusConnectionError: No server answered within ``config.connect_timeout_s``.
        ConfigError: The credentials cannot be read, or ``max_message_bytes`` exceeds the server's
            ``max_payload``.
    """
    nc = NatsClient()
    watch = ConnectionWatch(nc, config)
    options: dict[str, Any] = {
        "servers": config.servers,
        "name": config.name,
        "allow_reconnect": True,
        "connect_timeout": config.connect_timeout_s,
        "reconnect_time_wait": config.reconnect_wait_s,
        "max_reconnect_attempts": config.max_reconnect_attempts,
        "drain_timeout": config.drain_timeout_s,
        **watch.callbacks(),
    }
    options.update(auth_options(config))
    await _first_connect(nc, options, watch, config)
    if nc.max_payload < config.max_message_bytes:
        await abandon(nc)
        raise ConfigError(
            "bus",
            "bus.max_message_bytes",
            f"{config.max_message_bytes} exceeds the NATS server's max_payload of {nc.max_payload} bytes: "
            "lower bus.max_message_bytes or raise max_payload in the server's config",
        )
    watch.connected.set()
    log.debug("connected to NATS at %s", nc.connected_url.geturl() if nc.connected_url else config.servers)
    return nc, watch


async def _first_connect(nc: NatsClient, options: dict[str, Any], watch: ConnectionWatch, config: BusConfig) -> None:
    """Connect within ``config.connect_timeout_s``, ending early on a refusal; a failed client is closed."""
    servers = config.servers
    connecting = asyncio.ensure_future(nc.connect(**options))
    refusal = asyncio.ensure_future(watch.refused.wait())
    try:
        # nats-py retries the first connection without bound when reconnects are enabled, so
        # the overall deadline is ours; reconnect-after-loss semantics stay nats-py's.
        done, _ = await asyncio.wait(
            {connecting, refusal}, timeout=config.connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if connecting in done:
            connecting.result()
        elif refusal in done:
            reason = str(watch.last_error) if watch.last_error is not None else "authorization violation"
            raise BusAuthError(servers, config.user, reason)
        else:
            raise TimeoutError
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        await abandon(nc, connecting)
        cause = watch.last_error if watch.last_error is not None else exc
        if is_auth_violation(cause):
            raise BusAuthError(servers, config.user, f"{type(cause).__name__}: {cause}") from exc
        detail = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        raise BusConnectionError(servers, f"{detail} (gave up after {config.connect_timeout_s:g}s)") from exc
    except BaseException:
        await abandon(nc, connecting)
        raise
    finally:
        refusal.cancel()


async def abandon(nc: NatsClient, connecting: asyncio.Future[Any] | None = None) -> None:
    """Stop a client whose first connection failed, so no reconnect loop lingers."""
    if connecting is not None and not connecting.done():
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
    try:
        await nc.close()
    except Exception as exc:  # best effort: the connection never came up
        log.debug("closing a failed NATS client: %s", exc)
