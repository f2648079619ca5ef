"""Large images leave a service by reference: PNG in the artifact store, an ImageRef on the bus.

A 1920x1080 desktop screenshot is around a megabyte of PNG, and the same screen resized by a model's
rule is larger still (resampling removes what PNG compresses); a trajectory of such steps inline would
exceed any sane message limit. Two services hand out images: the env service its screenshots, the
rollout service the resized images its prompts were fed. Each sends an image above
``inline_max_bytes`` once to ``<prefix>/<sha256>.png`` (content-addressed: an unchanged image is
stored once, whichever instance, runner or episode saw it) and puts an
:class:`~dart.protocol.messages.ImageRef` with that URI and digest in its message; smaller ones stay
inline (the data manager stores those under the trajectory's own directory at ingestion).

A reference is only handed out for an object written within the last ``refresh_s`` seconds: an older
one is written again (same key, same bytes) first. The data manager's retention deletes images under
the prefix that no stored trajectory refers to once their last write is older than its grace period
(:mod:`dart.data.retention`); refreshing keeps every reference on its way to ingestion pointing at an
object younger than that.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from dart.protocol.errors import ArtifactNotFoundError
from dart.protocol.messages import ImageRef, InlineImage
from dart.runtime.store.interface import ArtifactStore

log = logging.getLogger("dart.runtime.store")

DEFAULT_PREFIX = "screenshots"
"""Key prefix of images stored by reference unless a service's config says otherwise."""
DEFAULT_REFRESH_S = 600.0
"""Refresh period of stored images unless a service's config says otherwise, seconds."""
_KNOWN_DIGESTS = 65536
"""Digests remembered as stored (saves a store round trip per repeated image), most recent kept."""


class ImageOffload:
    """Replaces images above a size with references to the artifact store (thread-safe).

    Args:
        store: Where images go; None keeps every image inline (a warning is logged once when one
            exceeds the threshold: the bus's message limit may then refuse the message).
        inline_max_bytes: Largest PNG kept inline, bytes; None keeps all inline.
        prefix: Key prefix of the stored images.
        refresh_s: Hand out a reference only to an object last written within this many seconds.
        clock: Wall-clock seconds (the store's modification times are wall-clock).
        setting: The setting that sets ``inline_max_bytes``, named in the warning.
    """

    def __init__(
        self,
        store: ArtifactStore | None,
        inline_max_bytes: int | None,
        prefix: str = DEFAULT_PREFIX,
        *,
        refresh_s: float = DEFAULT_REFRESH_S,
        clock: Callable[[], float] = time.time,
        setting: str = "inline_max_bytes",
    ) -> None:
        self.store = store
        self.inline_max_bytes = inline_max_bytes
        self.prefix = prefix.strip("/")
        self.refresh_s = refresh_s
        self.setting = setting
        self._clock = clock
        self._lock = threading.Lock()
        self._known: OrderedDict[str, tuple[str, float]] = OrderedDict()
        """digest -> (uri, when the object was last written as far as this process knows)"""
        self._warned = False
        self.stored = 0
        """Images written to the store."""
        self.referenced = 0
        """Images handed out as a reference."""

    def image(self, image: InlineImage) -> InlineImage | ImageRef:
        """``image`` itself, or a reference to its stored copy when it is above the threshold (blocking).

        Raises:
            StoreError: The store refused the write.
        """
        if self.inline_max_bytes is None or len(image.png) <= self.inline_max_bytes:
            return image
        if self.store is None:
            with self._lock:
                warn, self._warned = not self._warned, True
            if warn:
                log.warning(
                    "a %d-byte image exceeds %s (%d) but this service has no artifact store: it is sent inline; "
                    "give the service a store to send large images by reference",
                    len(image.png),
                    self.setting,
                    self.inline_max_bytes,
                )
            return image
        ref = self._put(image)
        with self._lock:
            self.referenced += 1
        return ref

    def _put(self, image: InlineImage) -> ImageRef:
        assert self.store is not None
        digest = hashlib.sha256(image.png).hexdigest()
        now = self._clock()
        with self._lock:
            known = self._known.get(digest)
            if known is not None and now - known[1] < self.refresh_s:
                self._known.move_to_end(digest)
                return _ref(known[0], digest, image)
        key = f"{self.prefix}/{digest}.png"
        written = self._written_at(key)
        if written is not None and now - written < self.refresh_s:
            uri = self.store.uri(key)
        else:  # new, or old enough that retention may delete it soon: (re)write it
            uri = self.store.put(key, image.png, content_type="image/png", sha256=digest).uri
            written = now
            with self._lock:
                self.stored += 1
        with self._lock:
            self._known[digest] = (uri, written)
            self._known.move_to_end(digest)
            if len(self._known) > _KNOWN_DIGESTS:
                self._known.popitem(last=False)
        return _ref(uri, digest, image)

    def _written_at(self, key: str) -> float | None:
        assert self.store is not None
        try:
            info = self.store.stat(key)
        except ArtifactNotFoundError:
            return None
        return info.modified.timestamp() if info.modified is not None else None


def _ref(uri: str, digest: str, image: InlineImage) -> ImageRef:
    return ImageRef(uri=uri, sha256=digest, width=image.width, height=image.height)
