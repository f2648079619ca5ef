"""Large screenshots leave the env service by reference: PNG in the artifact store, an ImageRef on the bus.

A 1920x1080 desktop screenshot is around a megabyte of PNG; a trajectory of such steps inline would
exceed any sane message limit. Screenshots above ``inline_max_bytes`` are written once to
``<prefix>/<sha256>.png`` (content-addressed: an unchanged screen is stored once, whichever
instance or episode saw it) and the observation carries an
:class:`~dart.protocol.messages.ImageRef` with that URI and digest; smaller ones stay inline.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict

from dart.protocol.messages import ImageRef, InlineImage, Observation
from dart.protocol.store import ArtifactStore

log = logging.getLogger("dart.env.service")

_KNOWN_DIGESTS = 65536
"""Digests remembered as stored (saves an existence check per repeated screen), most recent kept."""


class ScreenshotOffload:
    """Replaces screenshots above a size with references to the artifact store.

    Args:
        store: Where screenshots go; None keeps every screenshot inline (a warning is logged once
            when one exceeds the threshold: the bus's message limit may then refuse the reply).
        inline_max_bytes: Largest PNG sent inline, bytes; None sends all inline.
        prefix: Key prefix of the stored screenshots.
    """

    def __init__(self, store: ArtifactStore | None, inline_max_bytes: int | None, prefix: str = "screenshots") -> None:
        self.store = store
        self.inline_max_bytes = inline_max_bytes
        self.prefix = prefix.strip("/")
        self._known: OrderedDict[str, str] = OrderedDict()
        self._warned = False
        self.stored = 0
        """Screenshots written to the store."""
        self.referenced = 0
        """Observations sent with a reference."""

    async def observation(self, observation: Observation) -> Observation:
        """``observation`` with its screenshot by reference when it is above the threshold.

        Raises:
            StoreError: The store refused the write.
        """
        shot = observation.screenshot
        if not isinstance(shot, InlineImage) or self.inline_max_bytes is None or len(shot.png) <= self.inline_max_bytes:
            return observation
        if self.store is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "a %d-byte screenshot exceeds env.inline_max_bytes (%d) but the env service has no artifact "
                    "store: it is sent inline; give the service a store to send large screenshots by reference",
                    len(shot.png),
                    self.inline_max_bytes,
                )
            return observation
        ref = await asyncio.to_thread(self._put, shot)
        self.referenced += 1
        return observation.model_copy(update={"screenshot": ref})

    def _put(self, shot: InlineImage) -> ImageRef:
        assert self.store is not None
        digest = hashlib.sha256(shot.png).hexdigest()
        uri = self._known.get(digest)
        if uri is None:
            key = f"{self.prefix}/{digest}.png"
            if self.store.exists(key):
                uri = self.store.uri(key)
            else:
                uri = self.store.put(key, shot.png, content_type="image/png", sha256=digest).uri
                self.stored += 1
            self._known[digest] = uri
            if len(self._known) > _KNOWN_DIGESTS:
                self._known.popitem(last=False)
        else:
            self._known.move_to_end(digest)
        return ImageRef(uri=uri, sha256=digest, width=shot.width, height=shot.height)
