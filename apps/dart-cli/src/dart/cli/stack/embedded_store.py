"""The embedded S3 store of a run with ``run.artifacts: embedded_s3``: one definition for ``dart run``, which
starts it for the run, and ``dart view``, which starts it again on the same data to read the run back.

Its data lies in ``<run_dir>/s3``; the server picks fresh ports and a fresh admin key at every start and
admits one key pair per store role (``<run_dir>/secrets/s3-<role>.*``, see
:mod:`dart.cli.stack.store_credentials`), each bounded by its role's grants
(:mod:`dart.runtime.store.grants`). The admin key never leaves the server's process and its 0600 config;
a run's config.yaml names an endpoint that is gone once the run ended: readers start their own server.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dart.cli.stack.store_credentials import StoreKeyFiles, store_identities, write_store_keys
from dart.runtime.store import StoreConfig
from dart.runtime.store.grants import DEFAULT_PREFIXES, STORE_ROLES, StorePrefixes, StoreRole
from dart.runtime.store.uri import parse_store_uri

if TYPE_CHECKING:
    from dart.cli.stack.config import RunConfig
    from dart.embedded.s3 import EmbeddedS3

EMBEDDED_S3_URI = "s3://dart/artifacts"
"""Where ``run.artifacts: embedded_s3`` puts a run's artifacts."""


def run_store_prefixes(config: RunConfig) -> StorePrefixes:
    """The key prefixes ``config``'s services use, which bound their roles' grants."""
    return StorePrefixes(
        screenshots=config.env.screenshot_prefix,
        trajectories=config.data.blob_prefix,
        weights=config.train.weights_prefix,
    )


def embedded_s3_server(
    run_dir: Path, prefixes: StorePrefixes = DEFAULT_PREFIXES, host: str = "127.0.0.1"
) -> tuple[EmbeddedS3, dict[StoreRole, StoreKeyFiles]]:
    """The run's embedded S3 server (not started) listening on ``host``, keeping its data in ``<run_dir>/s3`` and
    admitting each store role's key pair (created if missing) with that role's grants; the pairs' files."""
    from dart.embedded.s3 import EmbeddedS3

    keys = write_store_keys(run_dir, STORE_ROLES)
    # Room for real checkpoints: 1,024 volumes of 256 MiB (256 GiB; a volume's file grows with what
    # it holds). The server's default of 64 x 64 MiB refuses writes past 4 GiB: one 3B version in fp32.
    server = EmbeddedS3(
        host=host,
        data_dir=run_dir / "s3",
        volume_size_limit_mb=256,
        max_volumes=1024,
        identities=store_identities(keys, EMBEDDED_S3_URI, prefixes),
        # The roles may not create buckets: the admin makes the run's before anyone writes.
        buckets=(parse_store_uri(EMBEDDED_S3_URI).root,),
    )
    return server, keys


def embedded_s3_store(s3: EmbeddedS3) -> StoreConfig:
    """The run's store on a started server, without keys: each reader adds its role's pair
    (:func:`dart.cli.stack.store_credentials.as_store_role`, or the environment of a ``dart serve``)."""
    return StoreConfig(uri=EMBEDDED_S3_URI, endpoint=s3.url, region=s3.region)
