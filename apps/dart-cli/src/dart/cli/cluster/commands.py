"""The command line of a service process, wherever it is started (light to import: Ray actors import it)."""

from __future__ import annotations

import sys


def serve_argv(service: str, config_file: str, python: str = sys.executable) -> list[str]:
    """The command line of ``dart serve <service> --config FILE``."""
    return [python, "-m", "dart.cli", "serve", service, "--config", config_file]
