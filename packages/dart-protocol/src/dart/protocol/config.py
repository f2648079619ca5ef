"""Config base types and loading.

Each component owns a pydantic config model derived from :class:`ConfigModel`, beside the code it
configures; a run's YAML file composes them. :func:`load_config` reads such a file, applies
environment and explicit overrides, and validates, failing with a :class:`ConfigError` that names
the file (or variable) and the dotted field path of every bad value.

Precedence, lowest to highest: model defaults < YAML file < ``DART_*`` environment < ``overrides``.

Example:
    >>> cfg = load_config(RunConfig, "examples/smoke.yaml", overrides={"bus.url": url})  # doctest: +SKIP

YAML is read with the YAML 1.2 core schema rather than PyYAML's YAML 1.1 default, so ``no``,
``on`` and ``yes`` stay strings, ``010`` is ten, ``1:30`` is a string and dates are strings that
pydantic converts only where a field asks for a date. Duplicate keys are errors.
"""

from __future__ import annotations

import difflib
import os
import re
import types
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError

from dart.protocol.errors import ConfigError, ConfigValidationError


class ConfigModel(BaseModel):
    """Base of every config model: unknown keys are errors, defaults are validated too."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)


M = TypeVar("M", bound=BaseModel)

_DEFAULTS_SOURCE = "<defaults>"
_SECRET_HINTS = ("secret", "password", "token", "key", "credential")


class _CoreLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars and duplicate-key detection."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _construct_core_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
    if digits.startswith("0o"):
        return sign * int(digits[2:], 8)
    if digits.startswith("0x"):
        return sign * int(digits[2:], 16)
    return sign * int(digits, 10)


_CORE_RESOLVERS: list[tuple[str, re.Pattern[str], str]] = [
    ("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), "tTfF"),
    ("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), "~nN"),
    ("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        re.compile(
            r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
        ),
        "-+0123456789.",
    ),
]
_REPLACED_TAGS = {tag for tag, _, _ in _CORE_RESOLVERS} | {"tag:yaml.org,2002:timestamp"}

# Rebuild the implicit resolvers: drop YAML 1.1's bool/int/float/null/timestamp, add the core ones.
_CoreLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _REPLACED_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _regexp, _first in _CORE_RESOLVERS:
    _CoreLoader.add_implicit_resolver(_tag, _regexp, list(_first))
_CoreLoader.yaml_implicit_resolvers.setdefault("", []).append(("tag:yaml.org,2002:null", re.compile(r"^$")))
_CoreLoader.add_constructor("tag:yaml.org,2002:int", _construct_core_int)


def parse_yaml(text: str) -> Any:
    """Parse YAML text with DART's loader (YAML 1.2 core scalars, duplicate keys rejected).

    Raises:
        yaml.YAMLError: The text is not valid YAML.
    """
    return yaml.load(text, Loader=_CoreLoader)  # safe: _CoreLoader derives from SafeLoader


EXTENDS_KEY = "extends"
"""Top-level key of a config file naming another file (relative to it) whose settings it starts from."""


def _merged(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` deep-merged onto ``base``: mappings merge key by key, any other value replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def _read_file(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file's settings; a file with ``extends: other.yaml`` is that file's settings with its own
    deep-merged on top (so a variant of a config states only what differs)."""
    data = _read_one_file(path)
    parent = data.pop(EXTENDS_KEY, None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent:
        raise ConfigError(str(path), EXTENDS_KEY, "must be the path of another config file, relative to this one")
    base_path = (path.parent / parent).resolve()
    if base_path in _seen or base_path == path.resolve():
        raise ConfigError(str(path), EXTENDS_KEY, f"{parent} extends this file again (a cycle)")
    return _merged(_read_file(base_path, (*_seen, path.resolve())), data)


def _read_one_file(path: Path) -> dict[str, Any]:
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            source, "", "file not found; pass the path of an existing YAML config (see examples/)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, "", f"cannot read the file: {exc}") from exc
    try:
        data = parse_yaml(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(source, "", f"invalid YAML{where}: {exc.problem or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(source, "", f"invalid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(source, "", f"expected a mapping of settings at the top level, got {type(data).__name__}")
    return data


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    """``(inner, optional)`` for ``X | None`` (and ``Annotated[X, ...]``); other types unchanged."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            inner, _ = _strip_optional(args[0])
            return inner, len(args) < len(get_args(annotation))
    return annotation, False


def _field_model(annotation: Any) -> type[BaseModel] | None:
    inner, _ = _strip_optional(annotation)
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def _model_at(model: type[BaseModel], parts: list[str]) -> type[BaseModel] | None:
    """The model class that holds the field at ``parts[-1]`` (walking nested models), if known."""
    current: type[BaseModel] | None = model
    for part in parts[:-1]:
        if current is None or part not in current.model_fields:
            return None
        current = _field_model(current.model_fields[part].annotation)
    return current


def _annotation_at(model: type[BaseModel], parts: list[str]) -> Any:
    holder = _model_at(model, parts)
    if holder is None or parts[-1] not in holder.model_fields:
        return None
    return holder.model_fields[parts[-1]].annotation


def _wants_string(annotation: Any) -> tuple[bool, bool]:
    """``(is a string-like field, accepts None)``: such fields take an env value verbatim."""
    inner, optional = _strip_optional(annotation)
    if inner in (str, SecretStr) or (isinstance(inner, type) and issubclass(inner, PurePath)):
        return True, optional
    if get_origin(inner) is Literal and all(isinstance(a, str) for a in get_args(inner)):
        return True, optional
    return False, optional


def _env_value(raw: str, annotation: Any) -> Any:
    """Parse an environment value: verbatim for string fields, else as a YAML scalar or flow collection."""
    is_str, optional = _wants_string(annotation)
    if is_str:
        # A secret such as "0123" must not turn into the number 123.
        return None if optional and raw in ("null", "~") else raw
    try:
        value = parse_yaml(raw)
    except yaml.YAMLError:
        return raw
    # "a: b" would parse as a mapping; only explicit flow collections ([..], {..}) are structured.
    if isinstance(value, dict | list) and not raw.lstrip().startswith(("[", "{")):
        return raw
    return value


def _set_path(data: dict[str, Any], parts: list[str], value: Any) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _flatten(overrides: Mapping[str, Any], prefix: list[str]) -> list[tuple[list[str], Any]]:
    out: list[tuple[list[str], Any]] = []
    for key, value in overrides.items():
        parts = prefix + str(key).split(".")
        if isinstance(value, Mapping) and value:
            out.extend(_flatten(value, parts))
        else:
            out.append((parts, value))
    return out


def _dotted(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _loc_parts(loc: tuple[int | str, ...]) -> list[str]:
    return [str(p) for p in loc]


def _union_models(annotation: Any) -> list[type[BaseModel]]:
    """The model classes among the members of a (possibly annotated, possibly optional) union."""
    found: list[type[BaseModel]] = []
    for arg in get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            found.append(arg)
        elif get_args(arg):
            found.extend(_union_models(arg))
    return found


def _field_loc(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``loc`` without the union tags pydantic inserts (``rollout.engine.plugin.kind`` -> ``rollout.engine.kind``),
    so an error names the key as written in the file."""
    out: list[int | str] = []
    choices: list[type[BaseModel]] = [model]
    for index, part in enumerate(loc):
        holder = next((m for m in choices if part in m.model_fields), None) if isinstance(part, str) else None
        if holder is not None and isinstance(part, str):
            out.append(part)
            choices = _union_models(holder.model_fields[part].annotation)
        elif len(choices) > 1 and isinstance(part, str) and index + 1 < len(loc):  # a union's tag: not a key
            after = loc[index + 1] if index + 1 < len(loc) else None
            choices = [m for m in choices if after in m.model_fields] or choices
        else:
            out.append(part)
            choices = []
    return tuple(out)


def _describe(model: type[BaseModel], err: Mapping[str, Any]) -> str:
    loc: tuple[int | str, ...] = tuple(err.get("loc", ()))
    parts = _loc_parts(loc)
    if err.get("type") == "extra_forbidden" and parts:
        holder = _model_at(model, parts)
        if holder is None:
            return "unknown key"
        valid = sorted(holder.model_fields)
        close = difflib.get_close_matches(parts[-1], valid, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return f"unknown key{hint} (valid keys here: {', '.join(valid)})"
    detail = str(err.get("msg", "invalid value"))
    value = err.get("input")
    if err.get("type") != "missing" and isinstance(value, str | int | float | bool) and value is not None:
        secret = any(h in part.lower() for part in parts for h in _SECRET_HINTS)
        shown = (
            "<hidden>"
            if secret
            else repr(value if not isinstance(value, str) or len(value) < 80 else value[:77] + "...")
        )
        detail += f" (got {shown})"
    return detail


def command_line_overrides(model_type: type[BaseModel], items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` arguments (``run.rl_duration_s=30``, ``data.retention={keep_versions: 2}``) as overrides
    for :func:`load_config`. Values parse as environment values do: verbatim for string fields, else as a
    YAML scalar or flow collection. Unknown keys are left for validation, which names them.

    Raises:
        ConfigError: An argument is not ``KEY=VALUE`` with a dotted key.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p.strip() for p in parts):
            raise ConfigError("command line", item, "expected KEY=VALUE with a dotted key, e.g. run.rl_duration_s=30")
        parts = [p.strip() for p in parts]
        out[".".join(parts)] = _env_value(raw, _annotation_at(model_type, parts))
    return out


def load_config(
    model_type: type[M],
    path: str | Path | None,
    *,
    env_prefix: str | None = "DART_",
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides_source: str = "overrides",
) -> M:
    """Load a config: YAML file, then environment, then overrides, then validate.

    Environment variables ``<env_prefix><A>__<B>=value`` set field ``a.b`` (names lower-cased,
    ``__`` separates levels). Only variables whose first level is a field of ``model_type`` apply,
    so unrelated ``DART_*`` variables (e.g. ``DART_NATS_SERVER``) are left alone. Values for
    string fields are taken verbatim; others are parsed as YAML scalars (``5``, ``0.5``, ``true``,
    ``null``) or flow collections (``[a, b]``, ``{k: v}``).

    Args:
        model_type: The pydantic model to produce.
        path: YAML file, or None for defaults plus overrides.
        env_prefix: Prefix of override variables; None disables environment overrides.
        overrides: Highest-precedence values, as dotted keys (``{"bus.url": ...}``) or nested
            mappings (``{"bus": {"url": ...}}``); nested mappings merge into the file's.
        environ: The environment to read (``os.environ`` by default).
        overrides_source: What error messages call the overrides (``command line`` for
            :func:`command_line_overrides`).

    Returns:
        The validated model.

    Raises:
        ConfigError: The file is missing or not YAML. Its subclass ConfigValidationError when
            values are invalid or keys unknown; it lists every failing field with its source.
    """
    source = str(path) if path is not None else _DEFAULTS_SOURCE
    data = _read_file(Path(path)) if path is not None else {}
    origins: dict[tuple[str, ...], str] = {}

    if env_prefix is not None:
        env = os.environ if environ is None else environ
        for name in sorted(env):
            if not name.startswith(env_prefix) or len(name) == len(env_prefix):
                continue
            parts = [p.lower() for p in name[len(env_prefix) :].split("__")]
            if any(not p for p in parts) or parts[0] not in model_type.model_fields:
                continue
            _set_path(data, parts, _env_value(env[name], _annotation_at(model_type, parts)))
            origins[tuple(parts)] = f"environment variable {name}"

    for parts, value in _flatten(overrides or {}, []):
        _set_path(data, parts, value)
        origins[tuple(parts)] = overrides_source

    try:
        return model_type.model_validate(data)
    except ValidationError as exc:
        problems: list[tuple[str, str, str]] = []
        for err in exc.errors(include_url=False):
            loc = _field_loc(model_type, tuple(err["loc"]))
            key = tuple(_loc_parts(loc))
            # Blame the most specific override that covers the failing field, else the file.
            where = next((origins[key[:n]] for n in range(len(key), 0, -1) if key[:n] in origins), source)
            problems.append((where, _dotted(loc), _describe(model_type, {**err, "loc": loc})))
        raise ConfigValidationError(problems) from None


def dump_config(model: BaseModel, *, exclude_defaults: bool = False) -> str:
    """Render a config as YAML that :func:`load_config` reads back to an equal model.

    Secrets (``SecretStr``) are written masked, so a dumped config is safe to log or store.
    """
    data = model.model_dump(mode="json", exclude_defaults=exclude_defaults)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False)
