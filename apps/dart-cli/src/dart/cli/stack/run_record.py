"""What a run directory records for ``dart run --resume``: enough to continue a run killed as a whole.

Two files, each replaced atomically:

- ``run-state.json``, written once the policy is ready: the DART version that made the run, the version-0
  policy's path and the warm start's figures (the summary's). A directory without it was not made by a DART
  that can resume it.
- ``rl_window.json`` (also read by ``dart view``), rewritten at every progress poll of the RL phase: when the
  window opened (``rl_start_unix_ns``), the RL seconds run so far (``rl_elapsed_s``; a resumed phase counts on
  from there, so ``run.rl_duration_s`` and ``run.min_versions`` count the whole run), the service restarts so
  far, and where the run was resumed.

Everything else a resumed run needs is already in the directory: the resolved ``config.yaml``, the NATS
server's JetStream store (streams, consumers, the state bucket), the embedded S3 server's data, the index, the
trainer's checkpoints and the NATS and store key files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from dart.protocol.errors import ConfigError

RUN_STATE_FILE = "run-state.json"
RL_WINDOW_FILE = "rl_window.json"
"""Written in the run directory when the RL window opens, so what reads a run in progress (``dart view``) uses
the window the summary will use; the summary records both ends."""


class RunState(BaseModel):
    """``run-state.json``."""

    dart_version: str
    policy: str
    """The version-0 policy (the warm-started checkpoint, or the base one)."""
    info: dict[str, Any] = Field(default_factory=dict)
    """The policy's figures for the summary (model init, warm start)."""


class Resumed(BaseModel):
    """One resume of the run."""

    at_unix_ns: int
    version: int
    """The newest published version when it resumed."""
    rl_elapsed_s: float
    """RL seconds run before it."""


class RlWindow(BaseModel):
    """``rl_window.json``."""

    rl_start_unix_ns: int
    rl_elapsed_s: float = 0.0
    service_restarts: list[dict[str, Any]] = Field(default_factory=list)
    resumed: list[Resumed] = Field(default_factory=list)


def write_json(path: Path, model: BaseModel) -> None:
    """Replace ``path`` with ``model`` as JSON in one step (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(model.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)


def read_window(run_dir: Path) -> RlWindow | None:
    """The run's RL window record, or None before the window opened."""
    path = run_dir / RL_WINDOW_FILE
    return RlWindow.model_validate(json.loads(path.read_text())) if path.is_file() else None


def resumable(run_dir: Path, version: str) -> RunState:
    """The state of ``run_dir`` if this DART (``version``) can resume it.

    Raises:
        ConfigError: It is not a run directory, it finished (``summary.json``), or another DART version
            made it (or one without resume: no ``run-state.json``).
    """
    source = "--resume"
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(source, "", f"{run_dir} is not a run directory (no config.yaml)")
    if (run_dir / "summary.json").is_file():
        raise ConfigError(source, "", f"{run_dir} finished (its summary.json is written): there is nothing to resume")
    path = run_dir / RUN_STATE_FILE
    if not path.is_file():
        raise ConfigError(
            source,
            "",
            f"{run_dir} has no {RUN_STATE_FILE}: it stopped before its policy was ready, or a DART "
            "that cannot resume runs made it",
        )
    state = RunState.model_validate(json.loads(path.read_text()))
    if state.dart_version != version:
        raise ConfigError(
            source, "", f"DART {state.dart_version} made {run_dir}; this is DART {version}: resume it with that version"
        )
    return state
