"""Publishing policy weights as versions: safetensors + manifest in the artifact store, announced on the bus.

Layout in the store (``prefix`` defaults to ``weights``)::

    weights/v3/model.safetensors   the model's state dict (names as ``model.state_dict()``), sha256 recorded
    weights/v3/manifest.json       WeightManifest: version, sha256, base model, trainer step, created_at

A :class:`~dart.protocol.messages.ModelVersion` pointing at both is then published on the ``model``
stream (msg id ``model-v<version>``, so a retried publish is stored once) and put into the ``state``
KV bucket under :data:`~dart.protocol.topology.LATEST_MODEL_KEY`, which the engines' sync controllers watch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from dart.protocol.bus import Bus, KeyValueStore
from dart.protocol.errors import JetStreamError
from dart.protocol.messages import ModelVersion
from dart.protocol.store import ArtifactStore
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.train.tied import with_tied_aliases_copied

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
MANIFEST_NAME = "manifest.json"


class WeightManifest(BaseModel):
    """The JSON manifest stored beside each published weights file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int
    """Policy version of the weights."""
    sha256: str
    """Hex digest of the safetensors file."""
    size_bytes: int
    """Size of the safetensors file."""
    weights_uri: str
    """Artifact URI of the safetensors file."""
    base_model: str
    """The checkpoint training started from."""
    trainer_step: int
    """Optimizer steps taken when the weights were saved."""
    created_at: float
    """Unix time, seconds."""
    format: str = "safetensors"
    """File format of the weights."""


class WeightPublisher:
    """Writes weight versions to the artifact store and announces them.

    Lifecycle: stateless between calls apart from :attr:`last`, the most recent announcement. Each
    :meth:`publish` goes ``saved`` (safetensors + manifest in the store, visible to anyone polling) ->
    ``announced`` (on the model stream, then in the KV). Versions must be published in increasing order;
    re-publishing a version overwrites its files and is deduplicated on the stream.

    Args:
        store: The artifact store weights go to.
        bus: The bus to announce on; None only writes to the store (offline use, tests).
        state: The ``state`` KV bucket (from :func:`~dart.protocol.topology.ensure_topology`); None skips the KV.
        prefix: Key prefix of weight versions in the store.
        announce_retry_s: How long an announcement is retried while the broker does not answer (a
            restart), seconds; then the error is raised.
    """

    def __init__(
        self,
        store: ArtifactStore,
        bus: Bus | None = None,
        state: KeyValueStore | None = None,
        *,
        prefix: str = "weights",
        announce_retry_s: float = 300.0,
    ) -> None:
        self.store = store
        self.announce_retry_s = announce_retry_s
        self.bus = bus
        self.state = state
        self.prefix = prefix.strip("/")
        self.last: ModelVersion | None = None

    def key(self, version: int, name: str = WEIGHTS_NAME) -> str:
        """Store key of a version's file."""
        return f"{self.prefix}/v{version}/{name}"

    def save(
        self, weights: dict[str, torch.Tensor], version: int, *, trainer_step: int, base_model: str
    ) -> ModelVersion:
        """Write the safetensors file and its manifest to the store (blocking); returns the announcement to send.

        Args:
            weights: CPU, contiguous tensors keyed like ``model.state_dict()``.
            version: The new policy version.
            trainer_step: Optimizer steps so far.
            base_model: Name of the initial checkpoint.
        """
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="dart-weights-") as tmp:
            path = Path(tmp) / WEIGHTS_NAME
            # Every name, a tied alias as its own copy: engines load the head from the file (dart.train.tied).
            save_file(
                with_tied_aliases_copied(weights), str(path), metadata={"format": "pt", "dart_version": str(version)}
            )
            info = self.store.put_file(self.key(version), path, content_type="application/octet-stream")
        assert info.sha256 is not None  # put_file always records the digest
        created_at = time.time()
        manifest = WeightManifest(
            version=version,
            sha256=info.sha256,
            size_bytes=info.size,
            weights_uri=info.uri,
            base_model=base_model,
            trainer_step=trainer_step,
            created_at=created_at,
        )
        manifest_info = self.store.put(
            self.key(version, MANIFEST_NAME),
            manifest.model_dump_json(indent=2).encode(),
            content_type="application/json",
        )
        return ModelVersion(
            version=version,
            uri=info.uri,
            sha256=info.sha256,
            manifest_uri=manifest_info.uri,
            size_bytes=info.size,
            trainer_step=trainer_step,
            base_model=base_model,
            created_at=created_at,
        )

    async def announce(self, model: ModelVersion) -> None:
        """Publish ``model`` on the model stream, then make it the latest version in the KV.

        While the broker does not answer (a restart, a network cut) the announcement is retried with
        backoff for up to ``announce_retry_s``: the stream publish is deduplicated by its message id
        (``model-v<version>``) and the KV put sets the same value, so a retry after a lost ack still
        announces the version once.

        Raises:
            JetStreamError: The broker did not take the announcement within ``announce_retry_s``.
            PermissionDeniedError: This connection may not publish the model (never retried).
        """
        deadline = time.monotonic() + self.announce_retry_s
        pause = 0.5
        while True:
            try:
                if self.bus is not None:
                    subject = self.bus.subjects.stream_subject("model")
                    await self.bus.js_publish(subject, model, msg_id=f"model-v{model.version}")
                if self.state is not None:
                    await self.state.put(LATEST_MODEL_KEY, model)
                break
            except JetStreamError as exc:
                if time.monotonic() + pause > deadline:
                    raise
                log.warning("announcing version %d failed (%s); retrying in %.1fs", model.version, exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 5.0)
        self.last = model

    async def publish(
        self, weights: dict[str, torch.Tensor], version: int, *, trainer_step: int, base_model: str
    ) -> ModelVersion:
        """Save (in a worker thread) and announce a version; returns its :class:`ModelVersion`."""
        model = await asyncio.to_thread(self.save, weights, version, trainer_step=trainer_step, base_model=base_model)
        await self.announce(model)
        return model


def weights_file(model: ModelVersion) -> Path:
    """Local path of a ``file://`` weights URI (what an engine's ``update_weights`` takes on one machine)."""
    from dart.protocol.store import parse_uri

    parsed = parse_uri(model.uri)
    return Path(os.fspath(parsed.path))
