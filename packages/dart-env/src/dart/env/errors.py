"""Errors raised by dart-env."""

from __future__ import annotations

from dart.protocol.errors import DartError


class EnvError(DartError):
    """Base class of env service errors."""


class SuiteError(EnvError):
    """A task suite file is missing or invalid.

    Attributes:
        path: The suite file.
    """

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"task suite {path}: {detail}")
