"""``python -m dart.env.sim``: regenerate the shipped suite files in ``dart/env/sim/suites/``."""

from __future__ import annotations

from pathlib import Path

from dart.env.sim.catalog import write_builtin_suites

if __name__ == "__main__":
    for path in write_builtin_suites(Path(__file__).parent / "suites"):
        print(f"wrote {path}")
