"""Versions of DART and of the installed ``dart-*`` distributions."""

from __future__ import annotations

import sys
from importlib import metadata

DART_PACKAGES: dict[str, str] = {
    "dart-protocol": "dart.protocol",
    "dart-runtime": "dart.runtime",
    "dart-policy": "dart.policy",
    "dart-env": "dart.env",
    "dart-rollout": "dart.rollout",
    "dart-data": "dart.data",
    "dart-train": "dart.train",
    "dart-embedded": "dart.embedded",
    "dart-cli": "dart.cli",
}
"""Distribution name -> import name of every package a DART install is made of."""


def package_version(distribution: str) -> str | None:
    """Installed version of a distribution, or None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def dart_version() -> str:
    """The DART version: that of the ``dart-cli`` distribution, the installation's entry point."""
    return package_version("dart-cli") or "unknown"


def installed_dart_packages() -> dict[str, str]:
    """``{distribution: version}`` of every installed ``dart-*`` distribution, sorted by name."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("dart-"):
            found[name] = dist.version
    return dict(sorted(found.items()))


def version_text() -> str:
    """What ``dart --version`` prints."""
    lines = [f"DART {dart_version()}"]
    packages = installed_dart_packages()
    width = max((len(n) for n in packages), default=0)
    lines += [f"  {name:<{width}}  {version}" for name, version in packages.items()]
    lines.append(f"  {'python':<{width}}  {sys.version.split()[0]}")
    return "\n".join(lines)
