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
from dart.cli.stack.store_credentials import as_store_role
from dart.cli.view.errors import NotARunError
from dart.cli.view.tokens import policy_checkpoint
from dart.data.config import BatchingConfig
from dart.data.serve import DataServeConfig
from dart.protocol.errors import ConfigError
from dart.runtime.serving import load_serve_config
from dart.runtime.store import StoreConfig

NO_BUS_CREDENTIALS = ("bus.password_env=null", "bus.password_file=null")
"""Overrides that drop a config's NATS credentials, which a deployment's services take from their own
environment (``DART_BUS__USER`` and the password) and the viewer, which never connects to NATS, lacks."""
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
        telemetry: The services' telemetry JSONL directory (None when unknown: a deployment opened
            without ``--telemetry``).
        policy: The policy checkpoint the config names, whose tokenizer gives tokens their text.
    """

    label: str
    database_url: str
    store: StoreConfig
    batching: BatchingConfig
    run_dir: Path | None = None
    telemetry: Path | None = None
    policy: Path | None = None

    def summary(self) -> tuple[dict[str, Any] | None, str]:
        """``summary.json`` of a finished ``dart run`` as it is now, or None and why there is none."""
        if self.run_dir is None:
            return None, "a deployment's services write no summary.json (only dart run does, when its run ends)"
        return _summary(self.run_dir)


@contextlib.contextmanager
def open_run(
    run_dir: Path | None = None, config: Path | None = None, telemetry: Path | None = None
) -> Iterator[RunSource]:
    """The run in ``run_dir`` (or the deployment of ``config``), its embedded S3 server started when it has one.

    ``telemetry`` is where the services' JSONL telemetry is, when not ``<run_dir>/telemetry``.

    Raises:
        NotARunError: The path is not a run directory (no config.yaml or no index) or the config does not load.
    """
    if (run_dir is None) == (config is None):
        raise NotARunError(run_dir or config or Path("."), "give a run directory or --config, one of them")
    if config is not None:
        yield replace(_deployment(config), telemetry=telemetry)
        return
    assert run_dir is not None
    source, embedded = _run_directory(run_dir)
    if telemetry is not None:
        source = replace(source, telemetry=telemetry)
    if not embedded:
        yield source
        return
    from dart.embedded.process import EmbeddedServerError

    server, keys = embedded_s3_server(source.run_dir or run_dir)
    try:
        server.start()
    except EmbeddedServerError as exc:
        reason = str(exc).splitlines()[0]
        raise NotARunError(run_dir, f"its S3 store's server did not start ({reason}; see s3/seaweedfs.log)") from exc
    try:
        # The viewer's own key pair: it may read the run's artifacts, never write or delete one.
        store = as_store_role(embedded_s3_store(server), keys["view"])
        yield replace(source, store=store.model_copy(update={"create_bucket": False}))
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
    raw = _raw(config_file)
    raw_run = raw.get("run") or {}
    # The index and the local store where they are now (the directory may have moved since the run).
    store = served.store or StoreConfig(uri=(run_dir / "artifacts").as_uri())
    embedded = raw_run.get("artifacts") == "embedded_s3" and store.uri == EMBEDDED_S3_URI
    if embedded and not (run_dir / "s3").is_dir():
        raise NotARunError(run_dir, "its config says run.artifacts: embedded_s3 but it has no s3/ directory")
    source = RunSource(
        label=str(run_dir),
        database_url=f"sqlite:///{index}",
        store=store,
        batching=served.data.batching,
        run_dir=run_dir,
        telemetry=run_dir / "telemetry",
        policy=policy_checkpoint(raw, run_dir),
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
        policy=policy_checkpoint(_raw(config_file), None),
    )


def _raw(config_file: Path) -> dict[str, Any]:
    """The config file as YAML (already loaded once by :func:`_load`, so it parses)."""
    raw = yaml.safe_load(config_file.read_text())
    return raw if isinstance(raw, dict) else {}


def _load(config_file: Path) -> DataServeConfig:
    if not config_file.is_file():
        raise NotARunError(config_file, "no such file")
    try:
        # The viewer never connects to the bus: its credentials are not asked for.
        return load_serve_config(DataServeConfig, config_file, NO_BUS_CREDENTIALS)
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
