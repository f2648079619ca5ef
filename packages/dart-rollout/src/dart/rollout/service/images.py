"""Screenshots for prompts: referenced ones fetched through a bounded cache, each turned into what the model is fed.

The env service sends large screenshots as :class:`~dart.protocol.messages.ImageRef` (PNG in the
artifact store, named by its sha256). A runner needs their pixels to build a prompt, and the same
screenshot is shown again in the next steps' prompts (``max_images``), so fetched PNGs are kept in
one LRU cache per rollout service, bounded by bytes, read through one store client per store
location (a bucket, a directory) that is kept open and reused.

:meth:`PromptImages.prepare` turns a screenshot into a :class:`~dart.policy.prompt.PromptImage`:
the RGB pixels handed to the processor and the record of exactly those pixels that the step stores
(``StepRecord.prompt_images``). A resized image is a new PNG; above ``rollout.prompt_images.inline_max_bytes``
it is stored content-addressed beside the env's screenshots and the step records a reference
(:mod:`dart.runtime.store.images`), so long episodes at 1920x1080 stay far below the bus's message limit.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from dart.policy.prompt import PromptImage, prompt_image
from dart.policy.screen import ImageSizing
from dart.protocol.errors import ConfigError, StoreError
from dart.protocol.messages import Image, ImageRef, InlineImage
from dart.protocol.png import check_png
from dart.rollout.errors import ImageFetchError, ImageStoreError
from dart.runtime.store import StoreConfig
from dart.runtime.store.cache import ArtifactCache
from dart.runtime.store.images import ImageOffload


class ImageCache:
    """PNG bytes of screenshot references for prompts, through one bounded :class:`ArtifactCache`.

    Args:
        store_config: Endpoint and credentials for ``s3://`` references.
        max_bytes: Upper bound on the cached PNG bytes.
    """

    def __init__(self, store_config: StoreConfig | None = None, *, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.artifacts = ArtifactCache(store_config, max_bytes=max_bytes)

    def get(self, ref: ImageRef) -> bytes:
        """The PNG bytes of ``ref`` (blocking; see :meth:`fetch`).

        Raises:
            ImageFetchError: The image is missing, unreadable or not the bytes its sha256 names.
        """
        try:
            return self.artifacts.get(ref.uri, ref.sha256)
        except (StoreError, ConfigError) as exc:
            raise ImageFetchError(ref.uri, str(exc)) from exc

    async def fetch(self, ref: ImageRef) -> bytes:
        """:meth:`get` in a worker thread."""
        return await asyncio.to_thread(self.get, ref)

    def close(self) -> None:
        """Close the pooled store clients and drop the cache."""
        self.artifacts.close()


class PromptImages:
    """Turns observations' screenshots into prompt images (the pixels fed and their record).

    Args:
        cache: Where referenced screenshots are read.
        size: How screenshots are sized (``runner.image_sizing()``): a square side, the model's resize
            rule, or None (fed as captured).
        offload: Where a resized image goes when it is too large to travel inline
            (``rollout.prompt_images``); None keeps every one inline.
    """

    def __init__(self, cache: ImageCache, size: ImageSizing, offload: ImageOffload | None = None) -> None:
        self.cache = cache
        self.size = size
        self.offload = offload

    async def prepare(self, screenshot: Image | None) -> PromptImage | None:
        """The prompt image of a screenshot (None for none); decoding, resizing and storing run in a thread.

        Raises:
            ImageFetchError: A referenced screenshot cannot be read.
            ImageStoreError: A resized image above the offload's threshold could not be stored.
        """
        if screenshot is None:
            return None
        png = await self.cache.fetch(screenshot) if isinstance(screenshot, ImageRef) else screenshot.png
        return await asyncio.to_thread(self._prepare, png, screenshot)

    def _prepare(self, png: bytes, screenshot: Image) -> PromptImage:
        # Decoded only when it is the size its message declares (a forged one could hold a huge image).
        try:
            check_png(png, screenshot.width, screenshot.height)
        except ValueError as exc:
            where = screenshot.uri if isinstance(screenshot, ImageRef) else "(inline)"
            raise ImageFetchError(where, str(exc)) from None
        fed = prompt_image(png, self.size, screenshot)
        if self.offload is None or not isinstance(fed.record, InlineImage) or fed.record is screenshot:
            return fed
        try:
            return replace(fed, record=self.offload.image(fed.record))
        except StoreError as exc:
            raise ImageStoreError(str(exc)) from exc
