"""One registry for everything that plugs in: env backends, inference engines, trainer backends, model
families, prompt formats and task-suite sources are all found the same way.

Each pluggable kind has one :class:`Registry`, kept by the package that defines the kind's interface
(``dart.env.interface.ENV_BACKENDS``, ``dart.rollout.engine.interface.ENGINES``,
``dart.train.interface.TRAINER_BACKENDS``, ``dart.policy.models.MODEL_FAMILIES``,
``dart.policy.formats.PROMPT_FORMATS``, ``dart.protocol.suite.SUITE_SOURCES``). Implementations come
in through Python entry points of the group ``dart.<kind>``: DART's own packages declare theirs in their
``pyproject.toml`` exactly as a third-party package would, so adding a backend never means editing DART::

    # a third-party package's pyproject.toml
    [project.entry-points."dart.env_backends"]
    mydesk = "mydesk.dart_plugin:factory"

An entry point is imported the first time its name is asked for, so an optional dependency (megatron-core,
the vLLM client, Selenium) loads only when a config chooses it, and a registry never imports its
implementations at start-up (no import cycles through it). Code may also :meth:`~Registry.register` an
object directly (tests do, for fault-injecting backends). ``dart doctor`` lists every registry's names and
where each comes from.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from dart.protocol.errors import ConfigError

T = TypeVar("T")

GROUP_PREFIX = "dart."
"""Entry-point groups are ``dart.<kind>``."""


class RegistryError(ConfigError):
    """A registered entry point could not be loaded (its module fails to import, or names nothing)."""


class Registry(Generic[T]):
    """The named implementations of one pluggable kind.

    Lifecycle: created empty by the package that defines the kind -> entry points of ``dart.<kind>`` are
    listed on first use (and loaded one by one as their names are asked for) -> code registrations may be
    added or removed at any time. Thread-safe.

    Args:
        kind: The kind's name; the entry-point group is ``dart.<kind>`` (e.g. ``env_backends``).
        what: How errors name one implementation (e.g. ``env backend``).
        config_field: The config field that selects an implementation, named by errors (e.g. ``env.backend``).
        check: Called on every loaded or registered object; raises ``TypeError`` for one of the wrong type.
    """

    def __init__(
        self, kind: str, *, what: str, config_field: str, check: Callable[[object], None] | None = None
    ) -> None:
        self.kind = kind
        self.group = GROUP_PREFIX + kind
        self.what = what
        self.config_field = config_field
        self._check = check
        self._lock = threading.Lock()
        self._registered: dict[str, T] = {}
        self._loaded: dict[str, T] = {}
        self._entry_points: dict[str, importlib.metadata.EntryPoint] | None = None

    def _points(self) -> dict[str, importlib.metadata.EntryPoint]:
        if self._entry_points is None:
            self._entry_points = {ep.name: ep for ep in importlib.metadata.entry_points(group=self.group)}
        return self._entry_points

    def register(self, name: str, obj: T, *, replace: bool = False) -> None:
        """Make ``obj`` available under ``name`` from code (entry points need no call).

        Raises:
            ValueError: ``name`` is taken (by code or an entry point) and ``replace`` is False.
            TypeError: ``obj`` is not of this registry's kind.
        """
        if self._check is not None:
            self._check(obj)
        with self._lock:
            if not replace and (name in self._registered or name in self._points()):
                raise ValueError(f"{self.what} {name!r} is registered already; pass replace=True to override it")
            self._registered[name] = obj

    def unregister(self, name: str) -> None:
        """Remove a code registration (no-op when absent; entry points stay)."""
        with self._lock:
            self._registered.pop(name, None)

    def names(self) -> list[str]:
        """Every registered name, sorted (entry points not loaded yet included)."""
        with self._lock:
            return sorted(set(self._registered) | set(self._points()))

    def sources(self) -> dict[str, str]:
        """Where each name comes from: ``module:attr (distribution)`` for an entry point, ``code`` otherwise."""
        with self._lock:
            out = {name: "code" for name in self._registered}
            for name, ep in self._points().items():
                if name not in out:
                    dist = ep.dist.name if ep.dist is not None else "?"
                    out[name] = f"{ep.value} ({dist})"
            return dict(sorted(out.items()))

    def check_name(self, name: str) -> str:
        """``name`` if something is registered under it (for config validators; nothing is imported).

        Raises:
            ValueError: Nothing has that name; the message lists what exists.
        """
        if name not in self.names():
            raise ValueError(self._unknown(name))
        return name

    def _unknown(self, name: str) -> str:
        return f"unknown {self.what} {name!r}; registered: {', '.join(self.names()) or 'none'} (group {self.group})"

    def get(self, name: str) -> T:
        """The implementation registered under ``name``, its entry point loaded on first use.

        Raises:
            ConfigError: Nothing has that name (the message lists what exists and the config field).
            RegistryError: Its entry point fails to load.
        """
        with self._lock:
            if name in self._registered:
                return self._registered[name]
            if name in self._loaded:
                return self._loaded[name]
            point = self._points().get(name)
        if point is None:
            raise ConfigError("config", self.config_field, self._unknown(name))
        try:
            obj: T = point.load()
        except Exception as exc:  # an import error of any kind: say which plug-in and why
            raise RegistryError(
                "config",
                self.config_field,
                f"{self.what} {name!r} ({point.value}) failed to load: {type(exc).__name__}: {exc}",
            ) from exc
        if self._check is not None:
            try:
                self._check(obj)
            except TypeError as exc:
                raise RegistryError(
                    "config", self.config_field, f"{self.what} {name!r} ({point.value}): {exc}"
                ) from None
        with self._lock:
            self._loaded[name] = obj
        return obj


def all_registries() -> list[Registry[object]]:
    """The registries of the DART packages installed here (for ``dart doctor``), in a fixed order."""
    import importlib

    found: list[Registry[object]] = []
    for module, attr in (
        ("dart.env.interface", "ENV_BACKENDS"),
        ("dart.rollout.engine.interface", "ENGINES"),
        ("dart.policy.models", "MODEL_FAMILIES"),
        ("dart.policy.formats", "PROMPT_FORMATS"),
        ("dart.train.interface", "TRAINER_BACKENDS"),
        ("dart.protocol.suite", "SUITE_SOURCES"),
    ):
        try:
            registry = getattr(importlib.import_module(module), attr)
        except ImportError:  # that package is not installed here
            continue
        found.append(registry)
    return found
