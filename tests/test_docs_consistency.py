"""What a newcomer reads names things that exist: every run-config key and every `dart` command the README
and the docs mention is checked against the config models and the command tree. (Every shipped example
config loads: apps/dart-cli/tests/test_examples.py.)"""

from __future__ import annotations

import re
import subprocess
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from typer.main import get_command

from dart.cli.main import app
from dart.cli.stack.config import RunConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(ROOT.glob("packages/*/README.md")),
    *sorted(ROOT.glob("apps/*/README.md")),
]
_SECTIONS = "|".join(RunConfig.model_fields)
# `data.retention.keep_versions` in backticks, and DART_DATA__RETENTION__KEEP_VERSIONS overrides.
_KEY = re.compile(rf"`((?:{_SECTIONS})(?:\.[a-z_][a-z0-9_]*)+)`")
_ENV = re.compile(rf"DART_((?:{'|'.join(s.upper() for s in RunConfig.model_fields)})(?:__[A-Z0-9_]+)+)")
_COMMAND = re.compile(r"(?:`|uv run )dart ([a-z][a-z0-9-]*)(?: ([a-z][a-z0-9-]*))?")
_FILE = re.compile(r"\.(json|py|safetensors|yaml|md|jsonl|png)$")


def _models(annotation: object) -> list[type[BaseModel] | None]:
    """The config models a field's annotation can hold; None stands for a value with no sub-keys."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [None]


def _is_config_key(path: str) -> bool:
    current: list[type[BaseModel] | None] = [RunConfig]
    for part in path.split("."):
        if None in current:
            return True  # below a dict, list or scalar: not a key of ours any more
        following = [
            m
            for model in current
            if model is not None and part in model.model_fields
            for m in _models(model.model_fields[part].annotation)
        ]
        if not following:
            return False
        current = following
    return True


def _source_literals() -> set[str]:
    """Every dotted string literal in the packages' code: telemetry event and metric names live there."""
    files = subprocess.run(
        ["git", "ls-files", "packages/*/src/*.py", "apps/*/src/*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found: set[str] = set()
    for name in files:
        found.update(re.findall(r"\"([a-z_]+(?:\.[a-z_]+)+)\"", (ROOT / name).read_text()))
    return found


def test_every_config_key_the_docs_name_exists() -> None:
    literals = _source_literals()
    wrong = []
    for doc in DOCS:
        text = doc.read_text()
        keys = set(_KEY.findall(text)) | {".".join(p.lower() for p in e.split("__")) for e in _ENV.findall(text)}
        for key in sorted(keys):
            # `data.stats.rejected`: an attribute of the data.stats event (data.stats is no config section).
            event = ".".join(key.split(".")[:2])
            attribute = event in literals and not _is_config_key(event)
            if _is_config_key(key) or key in literals or attribute or _FILE.search(key):
                continue
            wrong.append(f"{doc.relative_to(ROOT)}: {key}")
    assert not wrong, "config keys the docs name that the config models do not have:\n" + "\n".join(wrong)


def test_every_dart_command_the_docs_name_exists() -> None:
    root = get_command(app)
    commands = getattr(root, "commands", {})
    wrong = []
    for doc in DOCS:
        for name, sub in sorted(set(_COMMAND.findall(doc.read_text()))):
            command = commands.get(name)
            group = getattr(command, "commands", None)
            if command is None or (group is not None and sub and sub not in group):
                wrong.append(f"{doc.relative_to(ROOT)}: dart {name} {sub}".rstrip())
    assert not wrong, "dart commands the docs name that do not exist:\n" + "\n".join(wrong)


def test_the_checks_catch_what_they_look_for() -> None:
    """The resolver refuses a key that is not there and accepts one under a union (engine, backend)."""
    assert _is_config_key("data.retention.image_grace_s")
    assert _is_config_key("rollout.engine.launch.max_model_len")  # only the vLLM engine has it
    assert _is_config_key("train.backend.tensor_parallel_size")  # only megatron has it
    assert not _is_config_key("train.image_size")
    assert not _is_config_key("data.batching.screenshots_in_prompt")
    assert not _is_config_key("data.retention.keep_last")  # a section that is also an event name
    assert _COMMAND.findall("run `dart nope` then uv run dart model init x") == [("nope", ""), ("model", "init")]
