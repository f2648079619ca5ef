"""``python -m dart.cli``: the same as the ``dart`` command."""

from dart.cli.main import app

app(prog_name="dart")
