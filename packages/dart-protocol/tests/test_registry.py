"""The registry of pluggable parts: entry points found, loaded on first use, errors that name the plug-in."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dart.protocol.errors import ConfigError
from dart.protocol.registry import Registry, RegistryError

pytestmark = pytest.mark.unit


def _install(root: Path, dist: str, group: str, entries: dict[str, str], modules: dict[str, str]) -> None:
    """A distribution on ``root`` (a sys.path entry) as pip would leave it: modules and a dist-info."""
    for name, source in modules.items():
        (root / f"{name}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = [f"[{group}]", *(f"{name} = {target}" for name, target in entries.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Path]:
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("plug_")]:
            del sys.modules[name]


def test_an_entry_point_is_listed_without_import_and_loaded_on_first_use(site: Path) -> None:
    _install(
        site,
        "plug-one",
        "dart.test_widgets",
        {"spinner": "plug_one:make", "broken": "plug_broken:make"},
        {"plug_one": "def make():\n    return 'spun'\n", "plug_broken": "import not_a_module_anywhere\n"},
    )
    widgets: Registry[object] = Registry("test_widgets", what="widget", config_field="widget.kind", check=_callable)
    assert widgets.names() == ["broken", "spinner"]
    assert widgets.sources()["spinner"] == "plug_one:make (plug-one)"
    assert "plug_one" not in sys.modules  # listing imports nothing
    make = widgets.get("spinner")
    assert callable(make) and make() == "spun" and "plug_one" in sys.modules
    with pytest.raises(
        RegistryError, match=r"widget 'broken' \(plug_broken:make\) failed to load: ModuleNotFoundError"
    ):
        widgets.get("broken")
    with pytest.raises(ConfigError, match=r"field 'widget.kind'.*unknown widget 'gear'; registered: broken, spinner"):
        widgets.get("gear")


def test_code_registrations_refuse_a_taken_name_unless_replacing(site: Path) -> None:
    _install(site, "plug-two", "dart.test_gadgets", {"lamp": "plug_two:make"}, {"plug_two": "def make():\n    pass\n"})
    gadgets: Registry[object] = Registry("test_gadgets", what="gadget", config_field="gadget", check=_callable)
    with pytest.raises(ValueError, match="gadget 'lamp' is registered already"):
        gadgets.register("lamp", print)
    gadgets.register("lamp", print, replace=True)
    assert gadgets.get("lamp") is print and gadgets.sources()["lamp"] == "code"
    with pytest.raises(TypeError, match="callable"):
        gadgets.register("bulb", 42)
    gadgets.unregister("lamp")
    assert gadgets.sources()["lamp"] == "plug_two:make (plug-two)"


def test_an_entry_point_of_the_wrong_kind_is_refused_by_name(site: Path) -> None:
    _install(site, "plug-three", "dart.test_tools", {"hammer": "plug_three:VALUE"}, {"plug_three": "VALUE = 3\n"})
    tools: Registry[object] = Registry("test_tools", what="tool", config_field="tool", check=_callable)
    with pytest.raises(RegistryError, match=r"tool 'hammer' \(plug_three:VALUE\): must be callable"):
        tools.get("hammer")


def _callable(obj: object) -> None:
    if not callable(obj):
        raise TypeError(f"must be callable, got {obj!r}")
