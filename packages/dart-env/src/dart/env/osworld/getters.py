"""OSWorld's evaluator getters that a VM server (real or local) can answer, written for DART.

A getter turns a getter spec (``{"type": "vm_file", "path": ..., "dest": ...}``) into the value a
metric compares: a host path of a downloaded file, a command's output, a literal rule, a directory
tree. Same names, parameters and return values as OSWorld's ``desktop_env/evaluators/getters``.
Files land in the context's cache directory. Paths in getter parameters are mapped by the
evaluator (:class:`~dart.env.osworld.paths.PathMap`) before a getter sees them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import requests

from dart.env.osworld.client import VMServerClient
from dart.env.osworld.errors import EvaluatorError, UnsupportedStepError
from dart.env.osworld.paths import inside


@dataclass
class GetterContext:
    """What getters work with.

    Attributes:
        client: The VM server.
        cache_dir: Host directory for downloaded files (the task's cache).
        network: Whether ``cloud_file`` may download.
    """

    client: VMServerClient
    cache_dir: Path
    network: bool = False


Getter = Callable[[GetterContext, dict[str, Any]], Any]


def _flag(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def _files(config: dict[str, Any]) -> tuple[list[str], list[str], list[int]]:
    if _flag(config.get("multi", False)):
        paths, dests = list(config["path"]), list(config["dest"])
        return paths, dests, list(config.get("gives", [0]))
    return [config["path"]], [config["dest"]], [0]


def _cached(ctx: GetterContext, name: str) -> Path:
    """The file ``name`` in the task's cache directory.

    Raises:
        EvaluatorError: ``name`` leads outside it.
    """
    try:
        return inside(ctx.cache_dir, name)
    except ValueError as exc:
        raise EvaluatorError(f"getter file {name!r}: {exc}") from None


def _collect(cache: list[str | None]) -> Any:
    return cache[0] if len(cache) == 1 else cache


def get_vm_file(ctx: GetterContext, config: dict[str, Any]) -> Any:
    """Download VM file(s) into the cache: the host path (None when the VM has no such file), or a
    list of them for ``multi`` (only the indices in ``gives``)."""
    paths, dests, gives = _files(config)
    ctx.cache_dir.mkdir(parents=True, exist_ok=True)
    out: list[str | None] = []
    for i, (path, dest) in enumerate(zip(paths, dests, strict=False)):
        local = _cached(ctx, dest)  # the task names it: never a host file outside the cache
        data = ctx.client.get_file(path)
        if data is None:
            if i in gives:
                out.append(None)
            continue
        local.write_bytes(data)
        if i in gives:
            out.append(str(local))
    return _collect(out)


def get_cloud_file(ctx: GetterContext, config: dict[str, Any]) -> Any:
    """Download reference file(s) from URLs into the cache (network only)."""
    if not ctx.network:
        raise UnsupportedStepError("getter cloud_file", "downloads the reference file; network is off")
    paths, dests, gives = _files(config)
    ctx.cache_dir.mkdir(parents=True, exist_ok=True)
    out: list[str | None] = []
    for i, (url, dest) in enumerate(zip(paths, dests, strict=False)):
        local = _cached(ctx, dest)
        if not local.exists():
            response = requests.get(url, timeout=60)
            response.raise_for_status()
            local.write_bytes(response.content)
        if i in gives:
            out.append(str(local))
    return _collect(out)


def get_cache_file(ctx: GetterContext, config: dict[str, Any]) -> str:
    """A file an earlier step wrote into the cache (``path`` relative to it)."""
    path = _cached(ctx, config["path"])
    if not path.exists():
        raise FileNotFoundError(str(path))
    return str(path)


def get_vm_command_line(ctx: GetterContext, config: dict[str, Any]) -> str | None:
    """The stdout of a command run on the VM (``command``, ``shell``)."""
    answer = ctx.client.execute(config["command"], shell=bool(config.get("shell", False)))
    return None if answer.get("output") is None else str(answer["output"])


def get_vm_command_error(ctx: GetterContext, config: dict[str, Any]) -> str | None:
    """The stderr of a command run on the VM."""
    answer = ctx.client.execute(config["command"], shell=bool(config.get("shell", False)))
    return None if answer.get("error") is None else str(answer["error"])


def get_rule(ctx: GetterContext, config: dict[str, Any]) -> Any:
    """The literal ``rules`` of the getter spec."""
    return config["rules"]


def get_list_directory(ctx: GetterContext, config: dict[str, Any]) -> Any:
    """The tree ``{"name", "type", "children"}`` under ``path`` on the VM (None if missing)."""
    return ctx.client.directory_tree(config["path"])


def get_vm_screen_size(ctx: GetterContext, config: dict[str, Any]) -> dict[str, int]:
    """``{"width", "height"}`` of the VM screen."""
    width, height = ctx.client.screen_size()
    return {"width": width, "height": height}


def get_vm_window_size(ctx: GetterContext, config: dict[str, Any]) -> Any:
    """``{"width", "height"}`` of the first window of class ``app_class_name`` (None if none)."""
    return ctx.client.window_size(config["app_class_name"])


def get_shortcuts_on_desktop(ctx: GetterContext, config: dict[str, Any]) -> dict[str, str]:
    """``{file name: contents}`` of the ``.desktop`` files on the VM user's desktop."""
    desktop = ctx.client.desktop_path()
    tree = ctx.client.directory_tree(desktop) or {}
    out: dict[str, str] = {}
    for node in tree.get("children", []):
        name = str(node.get("name", ""))
        if name.endswith(".desktop"):
            data = ctx.client.get_file(f"{desktop.rstrip('/')}/{name}")
            out[name] = data.decode("utf-8", "replace") if data is not None else ""
    return out


# --- rule_relativeTime ---------------------------------------------------------------------------

_DOW = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MON = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTH = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")  # fmt: skip


def apply_time_format(fmt: str, day: datetime) -> str:
    """Fill OSWorld's date placeholders (``{DoW}``, ``{Month}``, ``{Day0D}``, ``{Year}`` ...) from ``day``."""
    for key, value in (
        ("{DoW}", _DOW[day.weekday()]),
        ("{Month}", _MON[day.month - 1]),
        ("{DayD}", str(day.day)),
        ("{Year}", str(day.year)),
        ("{Month0D}", f"{day.month:02d}"),
        ("{month}", _MONTH[day.month - 1].lower()),
        ("{MonthFull}", _MONTH[day.month - 1]),
        ("{Day0D}", f"{day.day:02d}"),
        ("{MonthD}", str(day.month)),
    ):
        fmt = fmt.replace(key, value, 1)
    return fmt


def _month_day(now: datetime, months_ahead: int, day: int) -> datetime:
    index = now.month - 1 + months_ahead
    return now.replace(year=now.year + index // 12, month=index % 12 + 1, day=day, hour=0, minute=0, second=0)


def _first_monday(now: datetime, months_ahead: int) -> datetime:
    first = _month_day(now, months_ahead, 1)
    return first + timedelta(days=(7 - first.weekday()) % 7)


def resolve_relative_day(name: str, now: datetime, anchor: datetime | None = None, anchor_name: str = "") -> datetime:
    """The date an OSWorld relative-time phrase (``tomorrow``, ``next Monday`` ...) means at ``now``.

    ``anchor``/``anchor_name``: the ``from`` date of a range, which some ``to`` phrases are relative to.
    """
    wd = now.weekday()
    simple: dict[str, Callable[[], datetime]] = {
        "tomorrow": lambda: now + timedelta(days=1),
        "this month": lambda: now,
        "5th next month": lambda: _month_day(now, 1, 5),
        "10th next month": lambda: _month_day(now, 1, 10),
        "11th next month": lambda: _month_day(now, 1, 11),
        "this Saturday": lambda: now + timedelta(days=5 - wd),
        "this Sunday": lambda: now + timedelta(days=6 - wd),
        "next Monday": lambda: now + timedelta(days=7 - wd),
        "next Monday split": lambda: now + timedelta(days=7 - wd),
        "next Saturday": lambda: now + timedelta(days=5 - wd if wd < 5 else (7 if wd == 5 else 6)),
        "next week Friday": lambda: now + timedelta(days=7 - wd + 4),
        "next week Saturday": lambda: now + timedelta(days=7 - wd + 5),
        "first monday four months later": lambda: _first_monday(now, 4),
        "first monday eight months later": lambda: _first_monday(now, 8),
    }
    if name in ("next Friday", "next Friday split"):
        if anchor is not None and anchor_name in ("next Monday", "next Monday split"):
            return anchor + timedelta(days=4)
        return now + timedelta(days=4 - wd if wd < 4 else (6 - wd) + 5)
    if name == "next Sunday":
        if anchor is not None and anchor_name in ("next Friday", "next Saturday"):
            return anchor + timedelta(days=6 - anchor.weekday())
        return now + timedelta(days=6 - wd if wd < 6 else 7)
    if name == "next week Sunday":
        if anchor is not None and anchor_name in ("next week Friday", "next week Saturday"):
            return anchor + timedelta(days=6 - anchor.weekday())
        return now + timedelta(days=7 - wd + 6)
    if name not in simple:
        raise EvaluatorError(f"rule_relativeTime: unknown relative time {name!r}")
    return simple[name]()


def get_rule_relativeTime(ctx: GetterContext, config: dict[str, Any], now: datetime | None = None) -> Any:
    """``rules`` with its ``expected`` date templates filled for today (``relativeTime.from``/``to``).

    The time zone is ``rules.timezone`` or UTC (OSWorld falls back to IP geolocation; DART never
    reaches the network for it).
    """
    rules = copy.deepcopy(config["rules"])
    try:
        zone = ZoneInfo(str(rules.get("timezone", "UTC")))
    except (ZoneInfoNotFoundError, ValueError):
        zone = ZoneInfo("UTC")
    now = now or datetime.now(zone)
    relative, expected = rules["relativeTime"], rules["expected"]
    start_name = relative["from"]
    start = resolve_relative_day(start_name, now)
    if "to" not in relative:
        expected["time"] = apply_time_format(expected["time"], start)
        return rules
    if start_name == "next Monday split":
        for key in ("puDay", "puMonth", "puYear"):
            expected[key] = apply_time_format(expected[key], start)
    else:
        expected["from"] = apply_time_format(expected["from"], start)
    end_name = relative["to"]
    end = resolve_relative_day(end_name, now, start, start_name)
    if end_name == "next Friday split":
        for key in ("doDay", "doMonth", "doYear"):
            expected[key] = apply_time_format(expected[key], end)
    else:
        expected["to"] = apply_time_format(expected["to"], end)
    return rules


BUILTIN_GETTERS: dict[str, Getter] = {
    "vm_file": get_vm_file,
    "cloud_file": get_cloud_file,
    "cache_file": get_cache_file,
    "vm_command_line": get_vm_command_line,
    "vm_command_error": get_vm_command_error,
    "rule": get_rule,
    "rule_relativeTime": get_rule_relativeTime,
    "list_directory": get_list_directory,
    "vm_screen_size": get_vm_screen_size,
    "vm_window_size": get_vm_window_size,
    "shortcuts_on_desktop": get_shortcuts_on_desktop,
}
"""Every getter DART implements, by OSWorld type name (``cloud_file`` needs network)."""
