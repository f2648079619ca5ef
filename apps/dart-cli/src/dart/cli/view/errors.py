"""Errors of ``dart view``: what it cannot open or show, each with the reason and what to do."""

from __future__ import annotations

from pathlib import Path

from dart.protocol.errors import DartError


class ViewError(DartError):
    """Base class of ``dart view`` errors."""


class NotARunError(ViewError):
    """The path given is not something ``dart view`` can open.

    Attributes:
        path: The run directory or config file given.
        reason: What is wrong with it.
    """

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"{path}: {reason}; pass a run directory `dart run` wrote (config.yaml and data.sqlite3) "
            "or --config with the run config of a deployment"
        )


class PageError(ViewError):
    """A page cannot be shown; the app answers with :attr:`status` and a page giving the reason.

    Attributes:
        what: What was asked for (``trajectory t-1``, ``image trajectories/t-1/ab.png``).
        reason: Why it cannot be shown, and what to do when something can be done.
    """

    status = 500

    def __init__(self, what: str, reason: str) -> None:
        self.what = what
        self.reason = reason
        super().__init__(f"{what}: {reason}")


class BadRequestError(PageError):
    """A query parameter that is not what the page takes (HTTP 400)."""

    status = 400


class NotFoundError(PageError):
    """Something a page asked for is not there (HTTP 404): an id the index does not hold, a blob or image
    the store does not (retention deleted it)."""

    status = 404


class UnreadableError(PageError):
    """Something is there but cannot be read as what it should be (HTTP 500): a blob that does not
    parse or whose bytes do not match their digest, an index or store that does not answer."""

    status = 500
