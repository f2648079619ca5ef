"""PNG headers are read before decoding: size as declared, and not above the maximum."""

from __future__ import annotations

import pytest

from dart.protocol.messages.observation import PNG_SIGNATURE
from dart.protocol.png import MAX_IMAGE_PIXELS, check_png, png_size
from dart.runtime.testing import png_header, tiny_png

pytestmark = pytest.mark.unit


def test_the_size_comes_from_the_header() -> None:
    assert png_size(tiny_png(7, 3)) == (7, 3)
    check_png(tiny_png(7, 3), 7, 3)
    with pytest.raises(ValueError, match=r"the PNG is 7x3, its message declares 3x7"):
        check_png(tiny_png(7, 3), 3, 7)
    with pytest.raises(ValueError, match="above the 33,177,600 pixels"):
        check_png(png_header(13000, 13000), 13000, 13000)
    assert 13000 * 13000 > MAX_IMAGE_PIXELS >= 7680 * 4320
    for junk in (b"GIF89a" + bytes(30), PNG_SIGNATURE + bytes(4)):
        with pytest.raises(ValueError, match="not a PNG"):
            png_size(junk)
