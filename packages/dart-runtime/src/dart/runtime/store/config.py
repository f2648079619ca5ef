"""Configuration of the artifact store, and the functions that open stores from it or from URIs.

Secrets never live in config values: the S3 access and secret keys are read from environment
variables named in the config (``DART_S3_ACCESS_KEY`` / ``DART_S3_SECRET_KEY`` by default, then
the AWS SDK's ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``) or from files referenced by path
(e.g. Docker or Kubernetes secrets), so a run's YAML can be committed and shared.

Example (YAML)::

    store:
      uri: s3://dart-artifacts/run-42
      endpoint: http://minio:9000
      access_key_file: /run/secrets/s3_access_key
      secret_key_file: /run/secrets/s3_secret_key
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from dart.protocol.config import ConfigModel
from dart.protocol.errors import ConfigError
from dart.runtime.store.interface import ArtifactStore, MiB
from dart.runtime.store.local import LocalStore
from dart.runtime.store.s3 import S3Store
from dart.runtime.store.uri import parse_store_uri, parse_uri

ENDPOINT_ENV = "DART_S3_ENDPOINT"
"""Environment variable consulted for the S3 endpoint when the config gives none."""
_FALLBACK_ENV = {"access": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY"}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class StoreConfig(ConfigModel):
    """Where artifacts are stored and how to reach the store.

    The S3 fields are ignored for ``file://`` stores, except by :func:`resolve_uri`, which uses
    them to read ``s3://`` artifact URIs announced by other services.
    """

    uri: str
    """Store URI: ``file:///ABSOLUTE/DIR`` or ``s3://BUCKET[/PREFIX]``."""
    endpoint: str | None = None
    """S3 API address, ``host:port`` or ``http(s)://host:port``; when None, ``$DART_S3_ENDPOINT``."""
    secure: bool | None = None
    """Use HTTPS; None means: as the endpoint URL's scheme says, else HTTPS."""
    region: str | None = None
    """Bucket region; None lets the SDK ask the server (one extra request per bucket)."""
    access_key_env: str = "DART_S3_ACCESS_KEY"
    """Name of the environment variable holding the access key (``AWS_ACCESS_KEY_ID`` is the fallback)."""
    secret_key_env: str = "DART_S3_SECRET_KEY"
    """Name of the environment variable holding the secret key (``AWS_SECRET_ACCESS_KEY`` is the fallback)."""
    access_key_file: Path | None = None
    """File holding the access key; takes precedence over the environment."""
    secret_key_file: Path | None = None
    """File holding the secret key; takes precedence over the environment."""
    create_bucket: bool = True
    """Create the bucket on the first write if it does not exist."""
    part_size_mb: int = Field(default=16, ge=5, le=5120)
    """Multipart part size for streamed uploads, in MiB; memory per upload is about twice this."""
    connect_timeout_s: float = Field(default=10.0, gt=0)
    """S3 connect timeout, in seconds."""
    read_timeout_s: float = Field(default=60.0, gt=0)
    """S3 read timeout (between response bytes), in seconds."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of an S3 request on connection errors and 5xx answers."""
    fsync: bool = True
    """Local store: flush writes to disk before returning."""

    @field_validator("uri")
    @classmethod
    def _check_uri(cls, value: str) -> str:
        parse_store_uri(value)
        return value

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            _split_endpoint(value)
        return value

    @field_validator("access_key_env", "secret_key_env")
    @classmethod
    def _check_env_name(cls, value: str) -> str:
        if not _ENV_NAME.match(value):
            raise ValueError(f"{value!r} is not an environment variable name (the value itself never goes in config)")
        return value

    def open(self) -> ArtifactStore:
        """Open the store this config describes (see :func:`open_store`)."""
        return open_store(self)

    def s3_settings(self) -> tuple[str, bool]:
        """The S3 ``host:port`` and whether to use HTTPS, from ``endpoint`` or ``$DART_S3_ENDPOINT``.

        Raises:
            ConfigError: No endpoint is configured, or it contradicts ``secure``.
        """
        raw = self.endpoint or os.environ.get(ENDPOINT_ENV)
        if not raw:
            raise ConfigError(
                "store", "store.endpoint", f"an s3:// store needs an endpoint: set store.endpoint or ${ENDPOINT_ENV}"
            )
        try:
            hostport, scheme_secure = _split_endpoint(raw)
        except ValueError as exc:
            raise ConfigError("env" if not self.endpoint else "store", "store.endpoint", str(exc)) from exc
        if scheme_secure is not None and self.secure is not None and scheme_secure != self.secure:
            raise ConfigError("store", "store.secure", f"secure={self.secure} contradicts the endpoint URL {raw!r}")
        secure = self.secure if self.secure is not None else (scheme_secure if scheme_secure is not None else True)
        return hostport, secure

    def credentials(self) -> tuple[str, str]:
        """The S3 access and secret keys, read now from the configured files or environment.

        Raises:
            ConfigError: A key is missing, or its file is unreadable or empty.
        """
        return (
            _read_secret("access", self.access_key_file, self.access_key_env),
            _read_secret("secret", self.secret_key_file, self.secret_key_env),
        )


def open_store(config_or_uri: StoreConfig | str) -> ArtifactStore:
    """Open an artifact store from a config or a store URI.

    A bare ``s3://`` URI takes its endpoint from ``$DART_S3_ENDPOINT`` and its credentials from
    the default environment variables.

    Example:
        >>> store = open_store("file:///var/lib/dart/artifacts")    # doctest: +SKIP
        >>> info = store.put("weights/v3/model.safetensors", data)   # doctest: +SKIP

    Raises:
        InvalidURIError: The URI is malformed or uses another scheme.
        ConfigError: An S3 endpoint or credential is missing.
    """
    config = StoreConfig(uri=config_or_uri) if isinstance(config_or_uri, str) else config_or_uri
    location = parse_store_uri(config.uri)
    if location.scheme == "file":
        return LocalStore(location.root, fsync=config.fsync)
    return _s3_store(config, location.root, location.prefix, create_bucket=config.create_bucket)


def resolve_uri(uri: str, config: StoreConfig | None = None) -> tuple[ArtifactStore, str]:
    """Open the store that holds an artifact URI, for reading it (e.g. weights announced by URI).

    ``file://`` URIs open a local store on the file's directory; ``s3://`` URIs open the URI's
    bucket with ``config``'s endpoint and credentials (or the environment's when None). The store
    never creates buckets or directories. Close it when done (it is a context manager).

    Returns:
        ``(store, key)`` such that ``store.get(key)`` reads the artifact.

    Raises:
        InvalidURIError: The URI is malformed or uses another scheme.
        ConfigError: An S3 endpoint or credential is missing.
    """
    parsed = parse_uri(uri)
    if parsed.scheme == "file":
        return LocalStore(parsed.root, fsync=config.fsync if config else True, create=False), parsed.key
    base = config or StoreConfig(uri=f"s3://{parsed.bucket}")
    return _pooled_s3_store(base, parsed.bucket), parsed.key


POOL_SIZE = 8
"""Most S3 clients :func:`resolve_uri` keeps (one per endpoint, bucket and credentials)."""
_POOL: OrderedDict[tuple[object, ...], S3Store] = OrderedDict()
_POOL_LOCK = threading.Lock()


def _pooled_s3_store(config: StoreConfig, bucket: str) -> S3Store:
    # One client per endpoint/bucket/credentials for the whole process, reused by every read
    # by URI (each screenshot of a batch): building a client per read cost a connection (and a
    # TLS handshake) per image. Least recently used first out when more than POOL_SIZE.
    endpoint, secure = config.s3_settings()
    access_key, secret_key = config.credentials()
    key = (
        endpoint,
        secure,
        config.region,
        bucket,
        access_key,
        hashlib.sha256(secret_key.encode()).hexdigest(),
        config.connect_timeout_s,
        config.read_timeout_s,
        config.max_retries,
    )
    with _POOL_LOCK:
        store = _POOL.get(key)
        if store is not None:
            _POOL.move_to_end(key)
            return store
        store = _s3_store(config, bucket, "", create_bucket=False)
        store.shared = True
        _POOL[key] = store
        evicted = _POOL.popitem(last=False)[1] if len(_POOL) > POOL_SIZE else None
    if evicted is not None:
        evicted.shared = False
        evicted.close()
    return store


def get_by_uri(uri: str, *, config: StoreConfig | None = None, verify: bool = True) -> bytes:
    """Read a whole artifact given its URI (see :func:`resolve_uri`).

    Raises:
        ArtifactNotFoundError: Nothing is stored at the URI.
        IntegrityError: The bytes do not match their recorded SHA-256.
    """
    store, key = resolve_uri(uri, config)
    with store:
        return store.get(key, verify=verify)


def _s3_store(config: StoreConfig, bucket: str, prefix: str, *, create_bucket: bool) -> S3Store:
    endpoint, secure = config.s3_settings()
    access_key, secret_key = config.credentials()
    return S3Store(
        bucket,
        endpoint=endpoint,
        access_key=access_key,
        secret_key=secret_key,
        secure=secure,
        region=config.region,
        prefix=prefix,
        create_bucket=create_bucket,
        part_size=config.part_size_mb * MiB,
        connect_timeout_s=config.connect_timeout_s,
        read_timeout_s=config.read_timeout_s,
        max_retries=config.max_retries,
    )


def _split_endpoint(value: str) -> tuple[str, bool | None]:
    """``host:port`` and the HTTPS flag implied by a URL scheme (None for a bare ``host:port``)."""
    if "://" not in value:
        if "/" in value or not value.strip() or value != value.strip():
            raise ValueError(f"{value!r} is not an S3 endpoint like minio:9000 or http://minio:9000")
        return value, None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an S3 endpoint like minio:9000 or http://minio:9000")
    if parts.username or parts.password:
        raise ValueError(f"{value!r} embeds credentials: use access_key_env/secret_key_env or *_file instead")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(f"{value!r} has a path: the S3 endpoint is only scheme://host:port")
    return parts.netloc, parts.scheme == "https"


def _read_secret(which: str, file: Path | None, env_name: str) -> str:
    if file is not None:
        try:
            value = file.read_text().strip()
        except OSError as exc:
            raise ConfigError(str(file), f"store.{which}_key_file", f"cannot read the {which} key: {exc}") from exc
        if not value:
            raise ConfigError(str(file), f"store.{which}_key_file", f"the {which} key file is empty")
        return value
    for name in (env_name, _FALLBACK_ENV[which]):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    raise ConfigError(
        "env",
        f"store.{which}_key_env",
        f"no S3 {which} key: set ${env_name} (or ${_FALLBACK_ENV[which]}), or store.{which}_key_file",
    )
