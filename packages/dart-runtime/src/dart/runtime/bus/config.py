"""Configuration of the NATS bus client.

Secrets never live in config values: a credentials file is referenced by path, and a token or a
password by the path of the file or the name of the environment variable that holds it, so a run's
YAML can be committed and shared.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from dart.protocol.config import ConfigModel
from dart.protocol.errors import ConfigError
from dart.protocol.subjects import DEFAULT_PREFIX, Subjects

_SCHEMES = ("nats", "tls", "ws", "wss")


class BusConfig(ConfigModel):
    """How a service connects to NATS and which subject namespace it uses.

    Example (YAML)::

        bus:
          url: [nats://nats-1:4222, nats://nats-2:4222]
          prefix: dart.v1
          run: exp-42
          user: rollout
          password_file: /run/secrets/nats_rollout_password
          tls_ca_file: /etc/dart/nats-ca.pem     # with tls:// URLs
    """

    url: str | list[str] = "nats://127.0.0.1:4222"
    """Server URL, or a list of cluster members tried in turn (``nats://``, ``tls://``, ``ws://``, ``wss://``)."""
    prefix: str = DEFAULT_PREFIX
    """Subject prefix; runs with different prefixes share a server without seeing each other."""
    run: str = "default"
    """Run id; JetStream streams, consumers and KV buckets are scoped to it."""
    name: str | None = None
    """Connection name shown in NATS monitoring (e.g. ``dart-env@host-3``)."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    """Deadline for the first connection, in seconds; :meth:`Bus.connect` fails after it."""
    request_timeout_s: float = Field(default=5.0, gt=0)
    """Default request/reply and JetStream API timeout, in seconds."""
    max_reconnect_attempts: int = Field(default=-1, ge=-1)
    """Reconnect attempts per server after a connection is lost; ``-1`` retries forever."""
    reconnect_wait_s: float = Field(default=2.0, ge=0)
    """Pause between reconnect attempts to the same server, in seconds."""
    creds_file: Path | None = None
    """Path to a NATS ``.creds`` file (JWT + nkey seed), for servers with decentralized auth."""
    token_env: str | None = None
    """Name of the environment variable holding an auth token (the token itself is never in config)."""
    user: str | None = None
    """NATS user (for servers with per-service users, e.g. ``rollout``); its password comes from
    ``password_file`` or ``password_env``. A user that is a subject token also names the reply
    inboxes (``_INBOX.<user>.…``), which per-service permissions rely on."""
    password_file: Path | None = None
    """File holding ``user``'s password (mode 0600; surrounding whitespace is ignored)."""
    password_env: str | None = None
    """Name of the environment variable holding ``user``'s password (when no ``password_file``)."""
    tls_ca_file: Path | None = None
    """PEM file of the CA(s) that signed the server certificate, for ``tls://`` URLs (None: system CAs)."""
    tls_cert_file: Path | None = None
    """PEM client certificate, for servers that verify clients (with ``tls_key_file``)."""
    tls_key_file: Path | None = None
    """PEM private key of ``tls_cert_file``."""
    serve_concurrency: int = Field(default=64, ge=1)
    """Default bound on concurrently running handlers of one served subject."""
    replicas: int = Field(default=1, ge=1, le=5)
    """Copies of each of the run's streams and buckets in a JetStream cluster (``dart nats --cluster 3``):
    3 keeps every queue through the loss of one node. More than the cluster has nodes is refused by the
    server when the topology is created. 1 for a single server."""
    drain_timeout_s: float = Field(default=10.0, gt=0)
    """How long :meth:`Bus.drain` waits for in-flight messages before closing, in seconds."""
    max_message_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """Largest encoded message this client sends, bytes; a larger one raises
    :class:`~dart.protocol.errors.PayloadTooLargeError` naming its subject and size. It must not exceed
    the server's ``max_payload`` (checked at connect; the embedded server's default is 8 MiB, a stock
    nats-server's 1 MiB). Screenshots above ``env.inline_max_bytes`` travel by reference to stay under it."""

    @field_validator("url")
    @classmethod
    def _check_urls(cls, value: str | list[str]) -> str | list[str]:
        urls = [value] if isinstance(value, str) else value
        if not urls:
            raise ValueError("at least one server URL is required")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in _SCHEMES or not parts.hostname:
                raise ValueError(f"{url!r} is not a NATS URL like nats://host:4222")
            if parts.password or parts.username:
                # Credentials in a URL end up in YAML files, logs and process listings.
                raise ValueError(f"{url!r} embeds credentials: use creds_file or token_env instead")
        return value

    @model_validator(mode="after")
    def _check_credentials(self) -> BusConfig:
        if self.password_file is not None and self.password_env is not None:
            raise ValueError("give either password_file or password_env, not both")
        if (self.password_file is not None or self.password_env is not None) and not self.user:
            raise ValueError("a password (password_file / password_env) needs bus.user")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("a client certificate needs both tls_cert_file and tls_key_file")
        return self

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        Subjects(prefix=value)
        return value

    @field_validator("run")
    @classmethod
    def _check_run(cls, value: str) -> str:
        Subjects(run=value)
        return value

    @property
    def servers(self) -> list[str]:
        """The server URLs as a list."""
        return [self.url] if isinstance(self.url, str) else list(self.url)

    def subjects(self) -> Subjects:
        """The subject builder for this config's prefix and run."""
        return Subjects(prefix=self.prefix, run=self.run)

    def token(self) -> str | None:
        """The auth token read from ``token_env`` at call time, or None when no token is configured.

        Raises:
            ConfigError: ``token_env`` names a variable that is unset or empty.
        """
        if self.token_env is None:
            return None
        token = os.environ.get(self.token_env)
        if not token:
            raise ConfigError("env", "bus.token_env", f"environment variable {self.token_env} is not set or empty")
        return token

    def password(self) -> str | None:
        """``user``'s password, read now from ``password_file`` or ``password_env``; None when neither is set.

        Raises:
            ConfigError: The file is unreadable or empty, or the variable is unset or empty.
        """
        if self.password_file is not None:
            try:
                value = self.password_file.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(str(self.password_file), "bus.password_file", f"cannot read it: {exc}") from exc
            if not value:
                raise ConfigError(str(self.password_file), "bus.password_file", "the password file is empty")
            return value
        if self.password_env is not None:
            value = os.environ.get(self.password_env, "").strip()
            if not value:
                raise ConfigError(
                    "env", "bus.password_env", f"environment variable {self.password_env} is not set or empty"
                )
            return value
        return None
