"""The artifact store: one interface, a local-directory backend and an S3 backend.

Example:
    >>> from dart.runtime.store import open_store
    >>> store = open_store("file:///var/lib/dart/artifacts")      # doctest: +SKIP
    >>> info = store.put("trajectories/t-1/step-0.png", png)       # doctest: +SKIP
    >>> store.get("trajectories/t-1/step-0.png") == png            # doctest: +SKIP
    True

See :mod:`dart.runtime.store.interface` for the contract, :mod:`~dart.runtime.store.local` and
:mod:`~dart.runtime.store.s3` for how each backend records digests, and
:mod:`~dart.runtime.store.config` for configuration and opening stores from URIs.
"""

from dart.runtime.store.config import StoreConfig, get_by_uri, open_store, resolve_uri
from dart.runtime.store.interface import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PART_SIZE,
    ArtifactInfo,
    ArtifactStore,
    ArtifactStream,
    BinaryReader,
)
from dart.runtime.store.local import LocalStore
from dart.runtime.store.s3 import S3Store
from dart.runtime.store.uri import (
    ArtifactURI,
    StoreLocation,
    file_uri,
    parse_store_uri,
    parse_uri,
    s3_uri,
    validate_key,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PART_SIZE",
    "ArtifactInfo",
    "ArtifactStore",
    "ArtifactStream",
    "ArtifactURI",
    "BinaryReader",
    "LocalStore",
    "S3Store",
    "StoreConfig",
    "StoreLocation",
    "file_uri",
    "get_by_uri",
    "open_store",
    "parse_store_uri",
    "parse_uri",
    "resolve_uri",
    "s3_uri",
    "validate_key",
]
