"""A bounded, content-addressed read cache over artifact URIs.

Screenshots travel by reference (``ImageRef``: URI + sha256); a rollout reads each one for several
prompts and a trainer for several passes. :class:`ArtifactCache` reads them by URI (through
:func:`~dart.runtime.store.resolve_uri`, whose S3 clients are pooled per endpoint and bucket), checks
each against the digest its reference names, and keeps the most recently used bytes up to a byte bound.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

from dart.protocol.errors import IntegrityError, InvalidURIError
from dart.runtime.store.config import StoreConfig, resolve_uri
from dart.runtime.store.interface import ArtifactStore
from dart.runtime.store.uri import key_in, parse_store_uri

StoreOpener = Callable[[str], tuple[ArtifactStore, str]]
"""Opens the store that holds an artifact URI: ``uri -> (store, key)``, as :func:`resolve_uri` does."""


class ArtifactCache:
    """Artifact bytes by URI and sha256, least recently used dropped first once over ``max_bytes``.

    Thread-safe (reads run in worker threads). Concurrent misses of one artifact may both read it;
    they get the same bytes. An artifact larger than ``max_bytes`` is returned but not kept.

    A URI outside the run's store (``store_config.uri``: its scheme, bucket and prefix, or its directory)
    is refused before anything is opened: references arrive in messages, and one naming
    ``file:///dev/zero`` or another bucket must not be read.

    Args:
        store_config: The run's store: where every URI read must lie, and the endpoint and credentials
            for ``s3://`` URIs (None: any ``file://`` URI and environment-configured S3, for tools and tests).
        max_bytes: Upper bound on the cached bytes.
        opener: Opens the store of a URI (default: :func:`resolve_uri` with ``store_config``); tests
            pass one that opens a real store with injected faults.
    """

    def __init__(
        self,
        store_config: StoreConfig | None = None,
        *,
        max_bytes: int = 256 * 1024 * 1024,
        opener: StoreOpener | None = None,
    ) -> None:
        self._store_config = store_config
        self._within = parse_store_uri(store_config.uri) if store_config is not None else None
        self._open: StoreOpener = opener or self._resolve
        self.max_bytes = max_bytes
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        """Reads served from the cache."""
        self.misses = 0
        """Reads that went to the store."""

    @property
    def cached_bytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def get(self, uri: str, sha256: str) -> bytes:
        """The bytes at ``uri``, which must hash to ``sha256`` (blocking: call from a thread in async code).

        Raises:
            ArtifactNotFoundError: Nothing is stored at ``uri``.
            IntegrityError: The bytes are not those ``sha256`` names.
            InvalidURIError: ``uri`` is malformed or lies outside the run's store.
            StoreError: The store could not be read.
            ConfigError: An S3 endpoint or credential is missing.
        """
        if self._within is not None and key_in(self._within, uri) is None:
            assert self._store_config is not None
            raise InvalidURIError(f"{uri} lies outside the run's store {self._store_config.uri}: not read")
        with self._lock:
            data = self._cache.get(sha256)
            if data is not None:
                self._cache.move_to_end(sha256)
                self.hits += 1
                return data
            self.misses += 1
        data = self._read(uri)
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise IntegrityError(uri, sha256, actual)
        with self._lock:
            if sha256 not in self._cache and len(data) <= self.max_bytes:
                self._cache[sha256] = data
                self._bytes += len(data)
                while self._bytes > self.max_bytes:
                    _, dropped = self._cache.popitem(last=False)
                    self._bytes -= len(dropped)
        return data

    def close(self) -> None:
        """Drop the cached bytes (the cache stays usable)."""
        with self._lock:
            self._cache.clear()
            self._bytes = 0

    def _resolve(self, uri: str) -> tuple[ArtifactStore, str]:
        return resolve_uri(uri, self._store_config)

    def _read(self, uri: str) -> bytes:
        store, key = self._open(uri)
        with store:
            # The digest the reference names is checked by the caller; the store's own check would read twice.
            return store.get(key, verify=False)
