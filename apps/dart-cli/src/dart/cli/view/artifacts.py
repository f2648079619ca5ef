"""Reading a run's trajectory blobs and images from its artifact store, with errors a page can show.

Blobs are read with dart-data's own :class:`~dart.data.blobs.TrajectoryBlobs`. Images are served by store
key: an :class:`~dart.protocol.messages.ImageRef` whose URI lies in the run's store maps to its key; one
that points elsewhere (another store) is named on the page but not fetched, so the viewer reads nothing
but the run's own store.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from dart.cli.view.errors import NotFoundError, UnreadableError
from dart.data.blobs import TrajectoryBlobs
from dart.protocol.errors import ArtifactNotFoundError, InvalidURIError, StoreError
from dart.protocol.messages import Image, ImageRef, Trajectory
from dart.runtime.store import ArtifactStore, validate_key

IMAGES_PRUNED = "retention deletes the images of old trajectories"

_CONTENT_TYPES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"RIFF", "image/webp"))


class RunArtifacts:
    """A run's store, read-only: trajectory blobs and the images they refer to (synchronous)."""

    def __init__(self, store: ArtifactStore) -> None:
        self.store = store
        self._blobs = TrajectoryBlobs(store)
        self._base = store.uri("probe")[: -len("probe")]

    def close(self) -> None:
        """Close the store."""
        self._blobs.close()
        self.store.close()

    def trajectory(self, row: dict[str, Any]) -> Trajectory:
        """The stored trajectory of an index row.

        Raises:
            NotFoundError: The blob is not in the store (retention deleted it, or it was never written).
            UnreadableError: The blob does not parse as a trajectory, or the store failed.
        """
        key = str(row["blob_key"])
        what = f"blob {key}"
        try:
            return self._blobs.get(key)
        except ArtifactNotFoundError as exc:
            pruned = row.get("pruned_at")
            reason = (
                "retention deleted this trajectory's objects (it was trained on and is older than the versions kept)"
                if pruned is not None
                else "it is not in the store (deleted outside the data manager, or the store is not this run's)"
            )
            raise NotFoundError(what, reason) from exc
        except ValidationError as exc:
            first = exc.errors()[0]
            place = ".".join(str(p) for p in first["loc"]) or "the document"
            raise UnreadableError(
                what, f"it does not parse as a trajectory ({exc.error_count()} errors; {place}: {first['msg']})"
            ) from exc
        except StoreError as exc:
            raise UnreadableError(what, f"the store failed: {exc}") from exc

    def key_of(self, image: Image | None) -> str | None:
        """The store key of an image reference in this store; None for inline images and other stores."""
        if not isinstance(image, ImageRef) or not image.uri.startswith(self._base):
            return None
        return image.uri[len(self._base) :]

    def exists(self, key: str) -> bool:
        """Whether the store holds ``key`` (False when the store cannot say)."""
        try:
            return self.store.exists(key)
        except StoreError:
            return False

    def image(self, key: str) -> tuple[bytes, str]:
        """An image's bytes and content type.

        Raises:
            NotFoundError: No such key (or not a valid key).
            UnreadableError: The store failed, or the bytes do not match their digest.
        """
        what = f"image {key}"
        if not key.endswith(".png"):  # screenshots and prompt images are PNGs; weights and JSON are not shown
            raise NotFoundError(what, "only the run's images (.png keys) are served")
        try:
            data = self.store.get(validate_key(key))
        except InvalidURIError as exc:
            raise NotFoundError(what, f"not a store key: {exc}") from exc
        except ArtifactNotFoundError as exc:
            raise NotFoundError(
                what, "it is not in the store (retention deletes the images of old trajectories)"
            ) from exc
        except StoreError as exc:
            raise UnreadableError(what, f"the store failed: {exc}") from exc
        kind = next((t for magic, t in _CONTENT_TYPES if data.startswith(magic)), None)
        if kind is None:
            raise NotFoundError(what, "it is not an image")
        return data, kind
