"""Trajectory blobs in the artifact store (synchronous; call from a thread).

Layout under ``<prefix>/<trajectory>/``: one ``<sha256>.png`` per distinct inline image (observation
screenshots and the images each step's prompt was fed, ``StepRecord.prompt_images``) and one
``trajectory-<sha256>.json`` holding the trajectory with every inline image replaced by an
:class:`~dart.protocol.messages.ImageRef`. Images that arrived by reference (the env service stores
large screenshots itself) keep their reference. Keys are derived from content, so storing the same
trajectory again (a redelivery, a retry after a crash) writes the same keys and changes nothing.

A trajectory's screenshots are uploaded concurrently (at most ``upload_concurrency`` at once, on
a thread pool the instance owns): a 15-step trajectory of 1920x1080 screenshots is some 15 objects
of a few MB, and one at a time each waits a full round trip to the store. The JSON goes last, so a
trajectory blob never refers to a screenshot that is not stored yet.
"""

from __future__ import annotations

import hashlib
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dart.protocol.messages import ImageRef, InlineImage, Trajectory
from dart.runtime.store import ArtifactStore
from dart.runtime.store.uri import is_valid_key

_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass(frozen=True)
class StoredTrajectory:
    """A trajectory whose screenshots are in the store.

    Attributes:
        trajectory: The trajectory with ImageRefs in place of inline screenshots.
        blob_key: Key of its JSON blob.
        blob_uri: URI of its JSON blob.
    """

    trajectory: Trajectory
    blob_key: str
    blob_uri: str


class TrajectoryBlobs:
    """Writes and reads trajectory blobs in one artifact store."""

    def __init__(self, store: ArtifactStore, prefix: str = "trajectories", *, upload_concurrency: int = 8) -> None:
        if upload_concurrency < 1:
            raise ValueError(f"upload_concurrency must be >= 1, got {upload_concurrency}")
        self.store = store
        self.prefix = prefix.strip("/")
        self.upload_concurrency = upload_concurrency
        self._uploads: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the upload threads (the store stays open: its owner closes it). Idempotent."""
        with self._lock:
            uploads, self._uploads = self._uploads, None
        if uploads is not None:
            uploads.shutdown(wait=True)

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._uploads is None:
                self._uploads = ThreadPoolExecutor(self.upload_concurrency, thread_name_prefix="dart-blob-upload")
            return self._uploads

    def directory(self, trajectory_id: str) -> str:
        """Key prefix of a trajectory's blobs (ids that are not key-safe are hashed)."""
        safe = trajectory_id if _SAFE_ID.match(trajectory_id) and trajectory_id not in {".", ".."} else None
        return f"{self.prefix}/{safe or 'h-' + hashlib.sha256(trajectory_id.encode()).hexdigest()[:32]}"

    def put(self, traj: Trajectory) -> StoredTrajectory:
        """Store a trajectory's screenshots and JSON; idempotent (content-derived keys)."""
        directory = self.directory(traj.trajectory_id)
        # Every inline image of the trajectory (observations and the prompts' images), once per content,
        # uploaded concurrently; then each step points at the stored copies.
        shots: dict[str, InlineImage] = {}
        digest_of: dict[int, str] = {}  # by object identity: each image is hashed once
        for step in traj.steps:
            for image in (step.observation.screenshot, *step.prompt_images):
                if isinstance(image, InlineImage) and id(image) not in digest_of:
                    digest_of[id(image)] = hashlib.sha256(image.png).hexdigest()
                    shots.setdefault(digest_of[id(image)], image)
        refs = self._put_pngs(directory, shots)

        def to_ref(image: InlineImage) -> ImageRef:
            return refs[digest_of[id(image)]]

        steps = []
        for step in traj.steps:
            shot = step.observation.screenshot
            if isinstance(shot, InlineImage):
                step = step.model_copy(
                    update={"observation": step.observation.model_copy(update={"screenshot": to_ref(shot)})}
                )
            if any(isinstance(image, InlineImage) for image in step.prompt_images):
                fed = [to_ref(image) if isinstance(image, InlineImage) else image for image in step.prompt_images]
                step = step.model_copy(update={"prompt_images": fed})
            steps.append(step)
        stored = traj.model_copy(update={"steps": steps})
        body = stored.model_dump_json().encode()
        digest = hashlib.sha256(body).hexdigest()
        key = f"{directory}/trajectory-{digest}.json"
        info = (
            self.store.stat(key)
            if self.store.exists(key)
            else self.store.put(key, body, content_type="application/json", sha256=digest)
        )
        return StoredTrajectory(stored, key, info.uri)

    def shared_image_keys(self, traj: Trajectory) -> list[str]:
        """Keys in this store of the images a stored trajectory refers to outside its own directory
        (screenshots the env service stored), each once; images in other stores are not listed."""
        own = self.directory(traj.trajectory_id) + "/"
        keys: dict[str, None] = {}
        for step in traj.steps:
            for image in (step.observation.screenshot, *step.prompt_images):
                key = self._key_of(image.uri) if isinstance(image, ImageRef) else None
                if key is not None and not key.startswith(own):
                    keys[key] = None
        return list(keys)

    def _key_of(self, uri: str) -> str | None:
        """The key of ``uri`` in this store, or None when it points elsewhere."""
        base = self.store.uri("probe")[: -len("probe")]
        key = uri[len(base) :] if uri.startswith(base) else None
        return key if key is not None and is_valid_key(key) else None  # no ".." segment climbs out

    def is_ours(self, ref: ImageRef) -> bool:
        """Whether an image reference lies in this store (the run's): the only place images are read from."""
        return self._key_of(ref.uri) is not None

    def image_exists(self, ref: ImageRef) -> bool:
        """Whether an image reference names a stored object in this store."""
        key = self._key_of(ref.uri)
        return key is not None and self.store.exists(key)

    def get(self, blob_key: str) -> Trajectory:
        """Read a stored trajectory back (screenshots stay references)."""
        return Trajectory.model_validate_json(self.store.get(blob_key))

    def _put_pngs(self, directory: str, shots: dict[str, InlineImage]) -> dict[str, ImageRef]:
        if len(shots) <= 1:
            return {d: self._put_png(f"{directory}/{d}.png", shot, d) for d, shot in shots.items()}
        pool = self._pool()
        futures = {d: pool.submit(self._put_png, f"{directory}/{d}.png", shot, d) for d, shot in shots.items()}
        return {d: future.result() for d, future in futures.items()}  # re-raises the first upload error

    def _put_png(self, key: str, shot: InlineImage, digest: str) -> ImageRef:
        # Skip the upload when a previous attempt already stored these bytes.
        if self.store.exists(key):
            uri = self.store.uri(key)
        else:
            uri = self.store.put(key, shot.png, content_type="image/png", sha256=digest).uri
        return ImageRef(uri=uri, sha256=digest, width=shot.width, height=shot.height)
