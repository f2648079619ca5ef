"""Errors of the data manager. Each carries structured fields and says what to do."""

from __future__ import annotations

from dart.protocol.errors import DartError


class DataError(DartError):
    """Base class of dart-data errors."""


class SchemaVersionError(DataError):
    """The database holds a schema newer than this code knows.

    Attributes:
        found: Schema version recorded in the database.
        supported: Newest version this code can migrate to.
    """

    def __init__(self, found: int, supported: int) -> None:
        self.found = found
        self.supported = supported
        super().__init__(
            f"database schema version {found} is newer than the supported {supported}: upgrade dart-data "
            "or point database_url at another database"
        )
