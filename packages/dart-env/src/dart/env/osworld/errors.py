"""Errors raised while reading OSWorld task files."""

from __future__ import annotations

from dart.env.errors import EnvError


class OSWorldTaskError(EnvError):
    """An OSWorld task file is unreadable or does not match the OSWorld task format.

    Attributes:
        path: The task file (or directory) at fault.
        field: Dotted location of the offending field (``evaluator.result.type``), or ``""``
            when the problem is the file as a whole.
        detail: What is wrong.
    """

    def __init__(self, path: str, field: str, detail: str) -> None:
        self.path = path
        self.field = field
        self.detail = detail
        where = f" field {field!r}" if field else ""
        super().__init__(f"OSWorld task {path}{where}: {detail}")
