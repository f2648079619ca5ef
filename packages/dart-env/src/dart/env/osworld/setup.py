"""Run an OSWorld task's setup steps (``config``) and an evaluator's ``postconfig`` against a VM server.

Step types and their parameters follow OSWorld's ``SetupController``:

- ``launch``: ``command`` (list or string), ``shell``: start a program, do not wait.
- ``execute`` / ``command``: ``command``, ``shell``, optional ``stdout``/``stderr`` (files in the cache
  directory to save the output to; a name leading outside it is refused) and ``until`` (retry until the
  output matches): run and wait. A command that exits non-zero is logged and recorded, not raised, as
  OSWorld does.
- ``sleep``: ``seconds``.
- ``open``: ``path``: open a file with its default application.
- ``activate_window`` / ``close_window``: ``window_name``, ``strict``, ``by_class``.
- ``upload_file``: ``files: [{"local_path", "path"}]``: copy files of the task's cache directory onto the
  VM (a ``local_path`` outside it is refused: a task comes in a request, and must not read host files).
- ``download``: ``files: [{"url", "path"}]``: fetch on the host, upload to the VM; only when network
  is allowed, else :class:`UnsupportedStepError`.

Anything else raises :class:`UnsupportedStepError` naming the step. Commands may hold OSWorld's
placeholders ``{SCREEN_WIDTH}``, ``{SCREEN_HEIGHT}``, ``{SCREEN_WIDTH_HALF}``, ``{SCREEN_HEIGHT_HALF}``
and ``{CLIENT_PASSWORD}``; they are filled in. Paths and commands go through a
:class:`~dart.env.osworld.paths.PathMap` (see that module for home-directory and ``sudo`` handling).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from dart.env.osworld.client import VMServerClient
from dart.env.osworld.errors import OSWorldVMError, SetupStepError, UnsupportedStepError
from dart.env.osworld.paths import PathMap, inside, strip_sudo, uses_sudo
from dart.env.osworld.tasks import SetupStep

log = logging.getLogger(__name__)

SUPPORTED_STEPS = frozenset(
    {"launch", "execute", "command", "sleep", "open", "activate_window", "close_window", "upload_file", "download"}
)
"""Step types :class:`SetupRunner` implements (``download`` only with network)."""


@dataclass
class StepRecord:
    """What one step did (for logs and evaluation details).

    Attributes:
        type: The step type.
        ok: Whether it succeeded (a command's return code was 0).
        detail: A short note (the return code and stderr of a failed command).
    """

    type: str
    ok: bool
    detail: str = ""


@dataclass
class SetupRunner:
    """Runs setup steps on one VM server.

    Attributes:
        client: The VM server.
        paths: How task paths map onto this VM.
        cache_dir: Host directory for downloads and saved command output.
        network: Whether ``download`` steps may fetch from the internet.
        root_sudo: Drop ``sudo`` prefixes (the desktop runs as root); when False a command that uses
            ``sudo`` runs as written on a real VM, and is unsupported on a local desktop
            (``local`` True).
        local: Whether the VM is DART's local desktop (sudo handling, see :mod:`~dart.env.osworld.paths`).
        client_password: What ``{CLIENT_PASSWORD}`` becomes (OSWorld's public VM default).
        max_sleep_s: Upper bound on one ``sleep`` step, seconds.
    """

    client: VMServerClient
    paths: PathMap = field(default_factory=PathMap.identity)
    cache_dir: Path | None = None
    network: bool = False
    root_sudo: bool = False
    local: bool = False
    client_password: str = "password"
    max_sleep_s: float = 30.0
    records: list[StepRecord] = field(default_factory=list)
    _screen: tuple[int, int] | None = None

    def run(self, steps: Sequence[SetupStep | dict[str, Any]]) -> list[StepRecord]:
        """Run steps in order; returns one record per step.

        Raises:
            UnsupportedStepError: A step type this runner (or this host) cannot run.
            SetupStepError: A step's parameters are missing or malformed.
            OSWorldVMError: The VM server failed.
        """
        out: list[StepRecord] = []
        for index, raw in enumerate(steps):
            step = raw if isinstance(raw, SetupStep) else SetupStep.model_validate(raw)
            record = self._run_one(index, step.type, self.paths.map(dict(step.parameters)))
            out.append(record)
            self.records.append(record)
        return out

    def _run_one(self, index: int, kind: str, params: dict[str, Any]) -> StepRecord:
        def need(name: str) -> Any:
            if name not in params:
                raise SetupStepError(index, kind, f"missing parameter {name!r}")
            return params[name]

        match kind:
            case "launch":
                self.client.launch(self._command(index, kind, need("command")), shell=bool(params.get("shell")))
            case "execute" | "command":
                return self._execute(index, kind, params)
            case "sleep":
                seconds = need("seconds")
                if not isinstance(seconds, int | float) or seconds < 0:
                    raise SetupStepError(index, kind, f"seconds must be a non-negative number, not {seconds!r}")
                time.sleep(min(float(seconds), self.max_sleep_s))
            case "open":
                self.client.open_file(str(need("path")))
            case "activate_window" | "close_window":
                call = self.client.activate_window if kind == "activate_window" else self.client.close_window
                name = str(need("window_name"))
                try:
                    call(name, strict=bool(params.get("strict")), by_class=bool(params.get("by_class")))
                except OSWorldVMError as exc:
                    if exc.status != 404:
                        raise
                    # OSWorld logs a missing window and goes on; so do we.
                    return StepRecord(kind, False, f"no window named {name!r}")
            case "upload_file":
                for entry in self._files(index, kind, need("files"), "local_path"):
                    local = self._in_cache(index, kind, entry["local_path"])  # never any other host file
                    if not local.is_file():
                        raise SetupStepError(index, kind, f"local file {local} does not exist")
                    self.client.upload(str(entry["path"]), local.read_bytes())
            case "download":
                if not self.network:
                    raise UnsupportedStepError(
                        f"step {index} download", "fetches files from the internet; network is off"
                    )
                for entry in self._files(index, kind, need("files"), "url"):
                    self.client.upload(str(entry["path"]), self._fetch(index, str(entry["url"])))
            case _:
                raise UnsupportedStepError(f"step {index} {kind!r}", "not a step type DART's setup runner implements")
        return StepRecord(kind, True)

    def _execute(self, index: int, kind: str, params: dict[str, Any]) -> StepRecord:
        if "command" not in params:
            raise SetupStepError(index, kind, "missing parameter 'command'")
        command = self._command(index, kind, params["command"])
        shell = bool(params.get("shell"))
        until = params.get("until") or {}
        deadline = time.monotonic() + (30.0 if until else 0.0)
        while True:
            answer = self.client.setup_execute(command, shell=shell)
            if not until or _until_met(answer, until) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        for key, name in (("output", "stdout"), ("error", "stderr")):
            if params.get(name) and self.cache_dir is not None:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                self._in_cache(index, kind, str(params[name])).write_text(str(answer.get(key) or ""))
        code = answer.get("returncode")
        ok = code in (0, None) and answer.get("status", "success") == "success"
        if not ok:
            detail = f"exit {code}: {str(answer.get('error') or answer.get('message') or '').strip()[:200]}"
            log.info("setup step %d (%s) failed: %s", index, kind, detail)
            return StepRecord(kind, False, detail)
        return StepRecord(kind, True)

    def _in_cache(self, index: int, kind: str, name: str) -> Path:
        """The host file ``name`` names, which must lie in the task's cache directory.

        Raises:
            SetupStepError: There is no cache directory, or ``name`` leads outside it.
        """
        if self.cache_dir is None:
            raise SetupStepError(index, kind, "names a host file, and this runner has no cache directory")
        try:
            return inside(self.cache_dir, name)
        except ValueError as exc:
            raise SetupStepError(index, kind, str(exc)) from None

    def _command(self, index: int, kind: str, raw: Any) -> str | list[str]:
        command: str | list[str]
        if isinstance(raw, list):
            command = [self._fill(str(c)) for c in raw]
        elif isinstance(raw, str):
            command = self._fill(raw)
        else:
            raise SetupStepError(index, kind, f"command must be a string or a list, not {type(raw).__name__}")
        if uses_sudo(command) and self.local:
            if not self.root_sudo:
                raise UnsupportedStepError(
                    f"step {index} {kind}", "uses sudo; the local desktop runs without root rights"
                )
            command = strip_sudo(command)
        return command

    def _fill(self, text: str) -> str:
        if "{SCREEN_" in text:
            if self._screen is None:
                self._screen = self.client.screen_size()
            width, height = self._screen
            for name, value in (
                ("SCREEN_WIDTH_HALF", width // 2),
                ("SCREEN_HEIGHT_HALF", height // 2),
                ("SCREEN_WIDTH", width),
                ("SCREEN_HEIGHT", height),
            ):
                text = text.replace("{" + name + "}", str(value))
        return text.replace("{CLIENT_PASSWORD}", self.client_password)

    @staticmethod
    def _files(index: int, kind: str, files: Any, source_key: str) -> list[dict[str, Any]]:
        if not isinstance(files, list) or not all(
            isinstance(f, dict) and source_key in f and "path" in f for f in files
        ):
            raise SetupStepError(index, kind, f"files must be a list of {{{source_key!r}, 'path'}} objects")
        return files

    def _fetch(self, index: int, url: str) -> bytes:
        try:
            response = requests.get(url, timeout=60)
            response.raise_for_status()
        except requests.RequestException as exc:
            raise SetupStepError(index, "download", f"cannot fetch {url}: {exc}") from None
        return response.content


def _until_met(answer: dict[str, Any], until: dict[str, Any]) -> bool:
    """OSWorld's ``until`` condition: ``returncode``, ``stdout`` or ``stderr`` (substring) match."""
    if "returncode" in until and answer.get("returncode") != until["returncode"]:
        return False
    if "stdout" in until and str(until["stdout"]) not in str(answer.get("output") or ""):
        return False
    return not ("stderr" in until and str(until["stderr"]) not in str(answer.get("error") or ""))


def placeholders(text: str) -> list[str]:
    """OSWorld placeholders (``{SCREEN_WIDTH}`` ...) left in a text (for checks)."""
    return re.findall(r"\{(SCREEN_[A-Z_]+|CLIENT_PASSWORD)\}", text)
