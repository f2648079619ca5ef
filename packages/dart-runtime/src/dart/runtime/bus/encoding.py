"""Messages to wire bytes without holding the event loop.

The codec compresses a large message (:func:`dart.protocol.messages.codec.pack`); that is CPU work of up to
a second or more for several megabytes that do not compress, so a service's sends run it in a worker thread
and its loop keeps serving. Small messages are encoded in place.
"""

from __future__ import annotations

import asyncio

from dart.protocol.messages.base import Message
from dart.protocol.messages.codec import COMPRESS_ABOVE_BYTES, pack, to_json


async def encode_message(msg: Message) -> bytes:
    """``codec.encode(msg)``, compressing a large message in a worker thread."""
    data = to_json(msg)
    if len(data) <= COMPRESS_ABOVE_BYTES:
        return data
    return await asyncio.to_thread(pack, data)
