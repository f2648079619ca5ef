"""PNG headers, read before any decoding: a PNG is only decoded when it is the size its message declares.

An image's bytes come from a message or from the store, and a message's ``width`` and ``height`` are
checked against nothing else: a forged or broken one could declare a small screen and hold a 13k x 13k
PNG (0.5 GB once decoded, from a few KB compressed). Every process that decodes a recorded image calls
:func:`check_png` first; it reads only the first 24 bytes.
"""

from __future__ import annotations

import struct

from dart.protocol.messages.observation import PNG_SIGNATURE

MAX_IMAGE_PIXELS = 7680 * 4320
"""Largest image decoded, pixels (an 8K screen): far above any desktop an agent is trained on."""


def png_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's header.

    Raises:
        ValueError: The bytes are not a PNG (signature, or no IHDR chunk first).
    """
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG file (bad signature)")
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file (no IHDR chunk after the signature)")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def check_png(data: bytes, width: int, height: int, *, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """Check that a PNG is the ``width`` x ``height`` image its message declares, and not over ``max_pixels``.

    Raises:
        ValueError: Not a PNG, another size than declared, or too large; the message says which.
    """
    actual = png_size(data)
    if actual != (width, height):
        raise ValueError(f"the PNG is {actual[0]}x{actual[1]}, its message declares {width}x{height}")
    if width * height > max_pixels:
        raise ValueError(f"the PNG is {width}x{height}, above the {max_pixels:,} pixels an image may have")
