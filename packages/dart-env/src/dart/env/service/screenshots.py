"""Large screenshots leave the env service by reference (see :mod:`dart.runtime.store.images`).

Screenshots above ``env.inline_max_bytes`` are written once to ``<screenshot_prefix>/<sha256>.png`` and
the observation carries an :class:`~dart.protocol.messages.ImageRef`; smaller ones stay inline.
"""

from __future__ import annotations

import asyncio

from dart.protocol.messages import InlineImage, Observation
from dart.runtime.store.images import ImageOffload


class ScreenshotOffload(ImageOffload):
    """An :class:`~dart.runtime.store.images.ImageOffload` for observations' screenshots."""

    async def observation(self, observation: Observation) -> Observation:
        """``observation`` with its screenshot by reference when it is above the threshold.

        Raises:
            StoreError: The store refused the write.
        """
        shot = observation.screenshot
        if not isinstance(shot, InlineImage) or self.inline_max_bytes is None or len(shot.png) <= self.inline_max_bytes:
            return observation
        sent = await asyncio.to_thread(self.image, shot)
        return observation if sent is shot else observation.model_copy(update={"screenshot": sent})
