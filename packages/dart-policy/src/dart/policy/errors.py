"""Exceptions of what the model sees and says: writing a checkpoint."""

from __future__ import annotations

from dart.protocol.errors import DartError


class ModelInitError(DartError, ValueError):
    """A checkpoint cannot be written as asked (unknown architecture, a layer count out of range, a dtype).

    The message names the setting and the values it may take.
    """
