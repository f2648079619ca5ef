"""Large screenshots leave the env service by reference: PNG in the artifact store, an ImageRef on the bus.

A 1920x1080 desktop screenshot is around a megabyte of PNG; a trajectory of such steps inline would
exceed any sane message limit. Screenshots above ``inline_max_bytes`` are written once to
``<prefix>/<sha256>.png`` (content-addressed: an unchanged screen is stored once, whichever
instance or episode saw it) and the observation carries an
:class:`~dart.protocol.messages.ImageRef` with that URI and digest; smaller ones stay inline.

A reference is only handed out for an object written within the last ``refresh_s`` seconds: an older
one is written again (same key, same bytes) first. The data manager's retention deletes screenshots no
stored trajectory refers to once their last write is older than its grace period
(:mod:`dart.data.retention`); refreshing keeps every reference on its way to ingestion pointing at an
object younger than that.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from dart.protocol.errors import ArtifactNotFoundError
from dart.protocol.messages import ImageRef, InlineImage, Observation
from dart.protocol.store import ArtifactStore

log = logging.getLogger("dart.env.service")

_KNOWN_DIGESTS = 65536
"""Digests remembered as stored (saves a store round trip per repeated screen), most recent kept."""


class ScreenshotOffload:
    """Replaces screenshots above a size with references to the artifact store.

    Args:
        store: Where screenshots go; None keeps every screenshot inline (a warning is logged once
            when one exceeds the threshold: the bus's message limit may then refuse the reply).
        inline_max_bytes: Largest PNG sent inline, bytes; None sends all inline.
        prefix: Key prefix of the stored screenshots.
        refresh_s: Hand out a reference only to an object last written within this many seconds.
        clock: Wall-clock seconds (the store's modification times are wall-clock).
    """

    def __init__(
        self,
        store: ArtifactStore | None,
        inline_max_bytes: int | None,
        prefix: str = "screenshots",
        *,
        refresh_s: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.inline_max_bytes = inline_max_bytes
        self.prefix = prefix.strip("/")
        self.refresh_s = refresh_s
        self._clock = clock
        self._known: OrderedDict[str, tuple[str, float]] = OrderedDict()
        """digest -> (uri, when the object was last written as far as this service knows)"""
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
        now = self._clock()
        known = self._known.get(digest)
        if known is not None and now - known[1] < self.refresh_s:
            self._known.move_to_end(digest)
            return self._ref(known[0], digest, shot)
        key = f"{self.prefix}/{digest}.png"
        written = self._written_at(key)
        if written is not None and now - written < self.refresh_s:
            uri = self.store.uri(key)
        else:  # new, or old enough that retention may delete it soon: (re)write it
            uri = self.store.put(key, shot.png, content_type="image/png", sha256=digest).uri
            written = now
            self.stored += 1
        self._known[digest] = (uri, written)
        self._known.move_to_end(digest)
        if len(self._known) > _KNOWN_DIGESTS:
            self._known.popitem(last=False)
        return self._ref(uri, digest, shot)

    def _written_at(self, key: str) -> float | None:
        assert self.store is not None
        try:
            info = self.store.stat(key)
        except ArtifactNotFoundError:
            return None
        return info.modified.timestamp() if info.modified is not None else None

    @staticmethod
    def _ref(uri: str, digest: str, shot: InlineImage) -> ImageRef:
        return ImageRef(uri=uri, sha256=digest, width=shot.width, height=shot.height)
