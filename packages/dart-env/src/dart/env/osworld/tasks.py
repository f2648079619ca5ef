"""Typed models of OSWorld task files, and their conversion to DART task specs.

An OSWorld task is one JSON file ``examples/<domain>/<id>.json``::

    {"id": "...", "snapshot": "os", "instruction": "...", "source": "...",
     "config": [{"type": "execute", "parameters": {"command": [...]}}],
     "related_apps": ["os"],
     "evaluator": {"postconfig": [...], "func": "exact_match",
                   "result": {"type": "vm_command_line", "command": "..."},
                   "expected": {"type": "rule", "rules": {"expected": "..."}}},
     "proxy": false, "fixed_ip": false, "possibility_of_env_change": "low"}

``func`` may be a list (several metrics, combined by ``conj``: ``and`` unless stated), in which case
``result``/``expected``/``options`` are parallel lists. Keys this module does not know are kept
(``model_extra``) and listed by :attr:`OSWorldTask.unknown_keys`, so new benchmark versions parse
and the audit can say what it ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dart.env.osworld.errors import OSWorldTaskError
from dart.protocol.messages import TaskSpec

BACKEND = "osworld"
"""The env backend name OSWorld task specs carry."""


class _Lenient(BaseModel):
    """Unknown keys are kept (not rejected), so newer task files still parse."""

    model_config = ConfigDict(extra="allow", frozen=True)

    @property
    def unknown_keys(self) -> tuple[str, ...]:
        """Keys present in the file that this model does not define, sorted."""
        return tuple(sorted(self.model_extra or {}))


class SetupStep(_Lenient):
    """One step of a task's ``config`` (before the episode) or the evaluator's ``postconfig``."""

    type: str = Field(min_length=1)
    """Step kind: ``download``, ``launch``, ``open``, ``execute``, ``command``, ``sleep`` ..."""
    parameters: dict[str, Any] = Field(default_factory=dict)
    """Kind-specific parameters (``command``, ``path``, ``files``, ``seconds`` ...)."""


class Getter(_Lenient):
    """An evaluator getter: where a metric's ``result`` or ``expected`` value comes from.

    Everything besides ``type`` is a getter parameter (``path``, ``command``, ``rules`` ...), kept
    as extra fields; :attr:`params` returns them.
    """

    type: str = Field(min_length=1)
    """Getter kind: ``vm_file``, ``vm_command_line``, ``rule``, ``cloud_file`` ..."""

    @property
    def params(self) -> dict[str, Any]:
        """The getter's parameters (every key but ``type``)."""
        return dict(self.model_extra or {})

    @property
    def unknown_keys(self) -> tuple[str, ...]:
        """Always empty: a getter's extra keys are its parameters, not unknown fields."""
        return ()


GetterSpec = Getter | list[Getter | None] | None
"""A single getter, or one per metric when ``func`` is a list (``null`` where a metric needs none)."""


class Evaluator(_Lenient):
    """How a task is scored: optional postconfig steps, then metric(s) over getter values."""

    func: str | list[str]
    """Metric name, or several metric names combined by :attr:`conj`."""
    conj: Literal["and", "or"] | None = None
    """How several metrics combine; OSWorld defaults to ``and``."""
    result: GetterSpec = None
    """Getter(s) of the value(s) the agent produced."""
    expected: GetterSpec = None
    """Getter(s) of the reference value(s)."""
    options: dict[str, Any] | list[dict[str, Any]] | None = None
    """Keyword options of the metric(s)."""
    postconfig: list[SetupStep] = Field(default_factory=list)
    """Steps run after the episode, before the getters (save the file, close the app ...)."""

    @field_validator("func")
    @classmethod
    def _func_names(cls, value: str | list[str]) -> str | list[str]:
        names = [value] if isinstance(value, str) else value
        if not names or any(not n for n in names):
            raise ValueError("must be a non-empty metric name or a non-empty list of them")
        return value

    @property
    def funcs(self) -> tuple[str, ...]:
        """The metric names, in order."""
        return (self.func,) if isinstance(self.func, str) else tuple(self.func)

    @property
    def getters(self) -> tuple[Getter, ...]:
        """Every getter the evaluator uses (results first, then expected values)."""
        out: list[Getter] = []
        for spec in (self.result, self.expected):
            if isinstance(spec, Getter):
                out.append(spec)
            elif isinstance(spec, list):
                out.extend(g for g in spec if g is not None)
        return tuple(out)


class OSWorldTask(_Lenient):
    """One OSWorld task file."""

    id: str = Field(min_length=1)
    """Task id (a UUID; also the file name)."""
    snapshot: str = ""
    """VM snapshot the task starts from (``os``, ``chrome``, ``libreoffice_calc`` ...)."""
    instruction: str = Field(min_length=1)
    """The natural-language goal."""
    source: str | list[str] = ""
    """Where the task came from (URL(s))."""
    trajectory: str = ""
    """Human trajectory folder (unused by DART)."""
    config: list[SetupStep] = Field(default_factory=list)
    """Setup steps run at reset, in order."""
    related_apps: list[str] = Field(default_factory=list)
    """Applications the task involves (free-form names: ``os``, ``chrome``, ``libreoffice calc`` ...)."""
    evaluator: Evaluator
    proxy: bool = False
    """Whether the task needs the benchmark's web proxy."""
    fixed_ip: bool = False
    """Whether the task needs a fixed public IP."""
    possibility_of_env_change: str = ""
    """How likely the live web content the task depends on changes (``low``/``medium``/``high``)."""

    @property
    def setup_steps(self) -> tuple[SetupStep, ...]:
        """Every setup step: ``config`` then the evaluator's ``postconfig``."""
        return (*self.config, *self.evaluator.postconfig)

    @property
    def infeasible(self) -> bool:
        """Whether the task is designed to be impossible (the agent must answer FAIL)."""
        return self.evaluator.funcs == ("infeasible",)

    @property
    def all_unknown_keys(self) -> tuple[str, ...]:
        """Unknown keys anywhere in the task, dotted (``hint``, ``evaluator._config_note`` ...)."""
        keys = list(self.unknown_keys)
        keys += [f"evaluator.{k}" for k in self.evaluator.unknown_keys]
        for where, steps in (("config", self.config), ("evaluator.postconfig", self.evaluator.postconfig)):
            keys += [f"{where}[{i}].{k}" for i, s in enumerate(steps) for k in s.unknown_keys]
        return tuple(keys)


@dataclass(frozen=True)
class OSWorldTaskFile:
    """A parsed task file with where it came from.

    Attributes:
        path: The JSON file.
        domain: Its domain (the parent directory name: ``os``, ``chrome`` ...).
        task: The parsed task.
        raw: The file's JSON object, unchanged (what a backend gets as ``params``).
    """

    path: Path
    domain: str
    task: OSWorldTask
    raw: dict[str, Any]

    @property
    def task_id(self) -> str:
        """The DART task id: ``osworld/<domain>/<id>``."""
        return f"{BACKEND}/{self.domain}/{self.task.id}"


def load_task_file(path: str | Path, domain: str | None = None) -> OSWorldTaskFile:
    """Parse one OSWorld task file.

    Args:
        path: The JSON file.
        domain: Its domain; defaults to the parent directory's name.

    Raises:
        OSWorldTaskError: The file is unreadable, not JSON, or not a valid task; the message names
            the file and the offending field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise OSWorldTaskError(str(path), "", f"cannot read: {exc}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OSWorldTaskError(str(path), "", f"not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise OSWorldTaskError(str(path), "", f"top level must be a JSON object, not {type(raw).__name__}")
    try:
        task = OSWorldTask.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = _field_path(raw, err["loc"], missing=err["type"] == "missing")
        more = f" (and {exc.error_count() - 1} more error(s))" if exc.error_count() > 1 else ""
        raise OSWorldTaskError(str(path), loc, f"{err['msg']}{more}") from None
    if task.id != path.stem:
        # The file name is how OSWorld's test lists find a task; a mismatch means a copy went wrong.
        raise OSWorldTaskError(str(path), "id", f"{task.id!r} does not match the file name {path.name!r}")
    return OSWorldTaskFile(path=path, domain=domain or path.parent.name, task=task, raw=raw)


def _field_path(raw: Any, loc: tuple[int | str, ...], *, missing: bool) -> str:
    """The dotted path of an error location in the file, without pydantic's union-member tags."""
    parts: list[str] = []
    node = raw
    for i, key in enumerate(loc):
        if isinstance(node, dict) and isinstance(key, str) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        elif not (missing and i == len(loc) - 1):
            continue  # a union member's tag ("str", "list[str]"), not a key of the file
        parts.append(str(key))
    return ".".join(parts)


def examples_dir(root: str | Path) -> Path:
    """The directory holding ``<domain>/<id>.json``: ``root/examples`` if present, else ``root``."""
    root = Path(root)
    return root / "examples" if (root / "examples").is_dir() else root


def load_task_dir(root: str | Path) -> list[OSWorldTaskFile]:
    """Parse every task file under an OSWorld task directory, sorted by domain then id.

    Args:
        root: An OSWorld checkout's ``evaluation_examples`` directory (holding ``examples/``), or the
            ``examples`` directory itself (holding one folder per domain).

    Raises:
        OSWorldTaskError: The directory is missing or holds no task files, or a file is invalid
            (the first bad file is named).
    """
    base = examples_dir(root)
    if not base.is_dir():
        raise OSWorldTaskError(str(root), "", "not a directory; pass an OSWorld evaluation_examples directory")
    paths = sorted(base.glob("*/*.json"))
    if not paths:
        raise OSWorldTaskError(str(base), "", "holds no <domain>/<id>.json task files")
    return [load_task_file(p) for p in paths]


def to_task_spec(file: OSWorldTaskFile, *, max_steps: int = 15, requires: tuple[str, ...] = ()) -> TaskSpec:
    """The DART task spec of an OSWorld task.

    The spec's ``params`` is the task's JSON unchanged, so the OSWorld backend can run its setup and
    evaluator; ``tags`` are the domain then the related apps; ``requires`` what an env must offer
    (:func:`dart.env.osworld.support.task_requirements`).
    """
    tags = dict.fromkeys([file.domain, *file.task.related_apps])
    return TaskSpec(
        task_id=file.task_id,
        backend=BACKEND,
        instruction=file.task.instruction,
        params=file.raw,
        max_steps=max_steps,
        tags=tuple(tags),
        requires=requires,
    )
