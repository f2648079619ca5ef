"""``python -m dart.cli``: the same as the ``dart`` command."""

import sys

if sys.argv[1:2] == ["serve"]:
    # Before the imports, which take seconds on a slow machine: a service stopped while starting exits 0.
    from dart.runtime.lifetime import stop_signals_end_startup

    stop_signals_end_startup()

from dart.cli.main import app

app(prog_name="dart")
