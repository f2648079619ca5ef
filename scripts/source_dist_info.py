"""Give each of DART's packages, run from source and uninstalled, a dist-info holding its entry points.

DART's registries (model families, env backends, ...) find their built-in implementations through the
entry points each package's pyproject declares; a package on PYTHONPATH has no installed metadata, so
they would find none. ``python scripts/source_dist_info.py SITE`` writes ``SITE/<name>-<version>.dist-info``
(METADATA and entry_points.txt) for every ``packages/*`` and ``apps/*`` project; SITE must be on sys.path.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(site: Path) -> None:
    for pyproject in sorted([*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]):
        project = tomllib.loads(pyproject.read_text())["project"]
        name, version = project["name"], project["version"]
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        groups = project.get("entry-points", {})
        sections = [
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) for group, points in groups.items()
        ]
        (info / "entry_points.txt").write_text("\n".join(sections))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
