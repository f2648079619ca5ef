"""The embedded S3 store of a run with ``run.artifacts: embedded_s3``: one definition for ``dart run``, which
starts it for the run, and ``dart view``, which starts it again on the same data to read the run back.

Its data lies in ``<run_dir>/s3``; the server picks fresh ports and keys at every start, so a run's
config.yaml names an endpoint that is gone once the run ended: readers start their own server.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from dart.protocol.store import StoreConfig

if TYPE_CHECKING:
    from dart.embedded.s3 import EmbeddedS3

EMBEDDED_S3_URI = "s3://dart/artifacts"
"""Where ``run.artifacts: embedded_s3`` puts a run's artifacts."""
S3_ACCESS_ENV, S3_SECRET_ENV = "DART_S3_ACCESS_KEY", "DART_S3_SECRET_KEY"
"""The environment variables the default :class:`StoreConfig` reads the S3 keys from."""


def embedded_s3_server(run_dir: Path) -> EmbeddedS3:
    """The run's embedded S3 server (not started), keeping its data in ``<run_dir>/s3``."""
    from dart.embedded.s3 import EmbeddedS3

    # Room for real checkpoints: 1,024 volumes of 256 MiB (256 GiB; a volume's file grows with what
    # it holds). The server's default of 64 x 64 MiB refuses writes past 4 GiB: one 3B version in fp32.
    return EmbeddedS3(data_dir=run_dir / "s3", volume_size_limit_mb=256, max_volumes=1024)


def embedded_s3_store(s3: EmbeddedS3) -> StoreConfig:
    """The run's store on a started server; its keys go into this process's environment (children inherit
    them), never into a config."""
    os.environ[S3_ACCESS_ENV], os.environ[S3_SECRET_ENV] = s3.access_key, s3.secret_key
    return StoreConfig(uri=EMBEDDED_S3_URI, endpoint=s3.url, region=s3.region)
