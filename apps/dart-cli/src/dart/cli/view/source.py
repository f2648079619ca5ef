"""Where a run's index and store are, and opening them read-only.

Two kinds of run:

- a run directory as ``dart run`` writes it: ``config.yaml``, the index ``data.sqlite3`` and the store,
  ``artifacts/`` or, with ``run.artifacts: embedded_s3``, an S3 store whose data lies in ``s3/``. The
  run's S3 server stopped with the run, so :func:`open_run` starts one on that directory and stops it
  when the viewer exits.
- a deployment's run config (``--config``): the index is ``data.database_url`` and the store the
  config's ``store`` section, with credentials from the environment as the services take them.

Either way the config is read as the data manager reads it (:class:`~dart.data.serve.DataServeConfig`:
its own section and the shared ones), so a run directory written by an older version, whose other
sections today's cross-service checks refuse, still opens.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from dart.cli.stack.embedded_store import EMBEDDED_S3_URI, embedded_s3_server, embedded_s3_store
from dart.cli.view.errors import NotARunError
from dart.data.config import BatchingConfig
from dart.data.serve import DataServeConfig
from dart.protocol.errors import ConfigError
from dart.protocol.serving import load_serve_config
from dart.protocol.store import StoreConfig

INDEX_FILE = "data.sqlite3"
"""The index of a run directory (``dart run`` sets ``data.database_url`` to it)."""


@dataclass(frozen=True)
class RunSource:
    """What ``dart view`` reads: one run's index and store.

    Attributes:
        label: What the user opened (the run directory or config file), for page titles.
        database_url: SQLAlchemy URL of the index.
        store: The artifact store holding the trajectory blobs and screenshots.
        batching: The data manager's batching settings (how it computes advantages).
        run_dir: The run directory, when one was opened.
        summary: ``summary.json`` of a finished ``dart run`` (None otherwise).
        summary_note: Why there is no summary (empty when there is one).
    """

    label: str
    database_url: str
    store: StoreConfig
    batching: BatchingConfig
    run_dir: Path | None = None
    summary: dict[str, Any] | None = None
    summary_note: str = ""


@contextlib.contextmanager
def open_run(run_dir: Path | None = None, config: Path | None = None) -> Iterator[RunSource]:
    """The run in ``run_dir`` (or the deployment of ``config``), its embedded S3 server started when it has one.

    Raises:
        NotARunError: The path is not a run directory (no config.yaml or no index) or the config does not load.
    """
    if (run_dir is None) == (config is None):
        raise NotARunError(run_dir or config or Path("."), "give a run directory or --config, one of them")
    if config is not None:
        yield _deployment(config)
        return
    assert run_dir is not None
    source, embedded = _run_directory(run_dir)
    if not embedded:
        yield source
        return
    from dart.embedded.process import EmbeddedServerError

    server = embedded_s3_server(source.run_dir or run_dir)
    try:
        server.start()
    except EmbeddedServerError as exc:
        reason = str(exc).splitlines()[0]
        raise NotARunError(run_dir, f"its S3 store's server did not start ({reason}; see s3/seaweedfs.log)") from exc
    try:
        yield replace(source, store=embedded_s3_store(server).model_copy(update={"create_bucket": False}))
    finally:
        server.stop()


def _run_directory(run_dir: Path) -> tuple[RunSource, bool]:
    """The run directory's source and whether its store is the embedded S3 one (which needs its server)."""
    run_dir = run_dir.resolve()
    config_file, index = run_dir / "config.yaml", run_dir / INDEX_FILE
    if not run_dir.is_dir():
        raise NotARunError(run_dir, "no such directory")
    if not config_file.is_file():
        raise NotARunError(run_dir, "it has no config.yaml")
    if not index.is_file():
        raise NotARunError(run_dir, f"it has no {INDEX_FILE} (the trajectory index)")
    served = _load(config_file)
    raw_run = (yaml.safe_load(config_file.read_text()) or {}).get("run") or {}
    # The index and the local store where they are now (the directory may have moved since the run).
    store = served.store or StoreConfig(uri=(run_dir / "artifacts").as_uri())
    embedded = raw_run.get("artifacts") == "embedded_s3" and store.uri == EMBEDDED_S3_URI
    if embedded and not (run_dir / "s3").is_dir():
        raise NotARunError(run_dir, "its config says run.artifacts: embedded_s3 but it has no s3/ directory")
    summary, note = _summary(run_dir)
    source = RunSource(
        label=str(run_dir),
        database_url=f"sqlite:///{index}",
        store=store,
        batching=served.data.batching,
        run_dir=run_dir,
        summary=summary,
        summary_note=note,
    )
    return source, embedded


def _deployment(config_file: Path) -> RunSource:
    served = _load(config_file)
    try:
        store = served.store_config()
    except ConfigError as exc:
        raise NotARunError(config_file, str(exc)) from exc
    return RunSource(
        label=str(config_file),
        database_url=served.data.database_url,
        store=store.model_copy(update={"create_bucket": False}),  # reading never creates a bucket
        batching=served.data.batching,
        summary_note="a deployment's services write no summary.json (only dart run does, when its run ends)",
    )


def _load(config_file: Path) -> DataServeConfig:
    if not config_file.is_file():
        raise NotARunError(config_file, "no such file")
    try:
        return load_serve_config(DataServeConfig, config_file)
    except (ConfigError, OSError, yaml.YAMLError) as exc:
        raise NotARunError(config_file, f"its config does not load: {exc}") from exc


def _summary(run_dir: Path) -> tuple[dict[str, Any] | None, str]:
    path = run_dir / "summary.json"
    if not path.is_file():
        return None, "no summary.json: the run is still going, or it crashed before writing one"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"summary.json does not parse: {exc}"
    if not isinstance(summary, dict):
        return None, "summary.json is not a JSON object"
    return summary, ""
