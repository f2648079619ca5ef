"""Publishing policy weights as versions: safetensors shards + manifest in the artifact store, announced on the bus.

Layout in the store (``prefix`` defaults to ``weights``; see :mod:`dart.protocol.weights`)::

    weights/v3/model.safetensors                      the state dict, when it fits one shard
    weights/v3/model-00001-of-00002.safetensors ...   else shards of at most ``shard_mib`` of tensor data,
    weights/v3/model.safetensors.index.json           and their index (tensor name -> shard)
    weights/v3/manifest.json                          WeightManifest: every shard's uri, size and sha256

Tensors are named as ``model.state_dict()`` names them and written in the publish dtype (floating-point
tensors cast to it; by default the dtype the trainer holds, ``train.dtype``). Each shard is streamed into
the store as it is serialized and hashed as it passes (one pass over the bytes; the manifest holds the
digests), ``publish.concurrency`` shards at a time: no shard is staged on disk or read back. The
manifest is written last, so a version whose manifest is readable is complete.

A :class:`~dart.protocol.messages.ModelVersion` naming the entry file (the one shard, or the index) and the
manifest is then published on the ``model`` stream (msg id ``model-v<version>``, so a retried publish is
stored once) and put into the ``state`` KV bucket under :data:`~dart.protocol.topology.LATEST_MODEL_KEY`,
which the engines' sync controllers watch.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dart.protocol.errors import JetStreamError, StoreError
from dart.protocol.messages import ModelVersion
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.protocol.weights import (
    ADAPTER_METADATA_KEY,
    INDEX_NAME,
    MANIFEST_NAME,
    WEIGHTS_NAME,
    AdapterSpec,
    WeightManifest,
    WeightShard,
    shard_name,
)
from dart.runtime.bus import Bus, KeyValueStore
from dart.runtime.retry import Backoff, retry
from dart.runtime.store import ArtifactStore
from dart.train.config import PublishConfig
from dart.train.errors import CheckpointError
from dart.train.shards import plan_shards, published_dtype, shard_stream

__all__ = ["MANIFEST_NAME", "WEIGHTS_NAME", "WeightManifest", "WeightPublisher", "weights_file"]

log = logging.getLogger(__name__)

_MIB = 1024 * 1024


class WeightPublisher:
    """Writes weight versions to the artifact store and announces them.

    Lifecycle: stateless between calls apart from :attr:`last`, the most recent announcement. Each
    :meth:`publish` goes ``saved`` (shards, index and manifest in the store, visible to anyone polling) ->
    ``announced`` (on the model stream, then in the KV). Versions must be published in increasing order;
    re-publishing a version overwrites its files and is deduplicated on the stream.

    Args:
        store: The artifact store weights go to.
        bus: The bus to announce on; None only writes to the store (offline use, tests).
        state: The ``state`` KV bucket (from :func:`~dart.runtime.topology.ensure_topology`); None skips the KV.
        prefix: Key prefix of weight versions in the store.
        announce_retry_s: How long an announcement is retried while the broker does not answer (a
            restart), seconds; then the error is raised.
        config: Shard size and dtype of what is written (default: one shard up to 4 GiB, as held).
    """

    def __init__(
        self,
        store: ArtifactStore,
        bus: Bus | None = None,
        state: KeyValueStore | None = None,
        *,
        prefix: str = "weights",
        announce_retry_s: float = 300.0,
        config: PublishConfig | None = None,
    ) -> None:
        self.store = store
        self.announce_retry_s = announce_retry_s
        self.bus = bus
        self.state = state
        self.prefix = prefix.strip("/")
        self.config = config or PublishConfig()
        self.last: ModelVersion | None = None

    def key(self, version: int, name: str = WEIGHTS_NAME) -> str:
        """Store key of a version's file."""
        return f"{self.prefix}/v{version}/{name}"

    def save(
        self,
        weights: dict[str, torch.Tensor],
        version: int,
        *,
        trainer_step: int,
        base_model: str,
        adapter: AdapterSpec | None = None,
    ) -> ModelVersion:
        """Write the shards, their index and the manifest to the store (blocking); returns the announcement to send.

        Args:
            weights: CPU, contiguous tensors keyed like ``model.state_dict()`` (tied aliases included), or an
                adapter's tensors.
            version: The new policy version.
            trainer_step: Optimizer steps so far.
            base_model: Name of the initial checkpoint.
            adapter: Set when ``weights`` is a LoRA adapter over ``base_model``: recorded in the file's
                metadata and the manifest (:mod:`dart.protocol.weights`).
        """
        dtype = getattr(torch, self.config.dtype) if self.config.dtype else None
        plan = plan_shards(weights, int(self.config.shard_mib * _MIB), dtype)
        metadata = {"format": "pt", "dart_version": str(version)}
        if adapter is not None:
            if len(plan) > 1:
                raise ValueError(f"an adapter is published as one file; {len(plan)} shards were planned")
            metadata[ADAPTER_METADATA_KEY] = adapter.model_dump_json()
        shards = self._write_shards(weights, version, plan, dtype, metadata)
        entry_uri, entry_sha256 = shards[0].uri, shards[0].sha256
        if len(shards) > 1:
            entry_uri, entry_sha256 = self._write_index(version, plan, shards)
        floating = {published_dtype(t, dtype) for t in weights.values() if t.is_floating_point()}
        created_at = time.time()
        manifest = WeightManifest(
            version=version,
            sha256=entry_sha256,
            size_bytes=sum(s.size_bytes for s in shards),
            weights_uri=entry_uri,
            base_model=base_model,
            trainer_step=trainer_step,
            created_at=created_at,
            dtype=",".join(sorted(str(d).removeprefix("torch.") for d in floating)) or None,
            shards=shards,
            adapter=adapter,
        )
        manifest_bytes = manifest.model_dump_json(indent=2).encode()
        manifest_sha256 = hashlib.sha256(manifest_bytes).hexdigest()
        manifest_info = self.store.put(
            self.key(version, MANIFEST_NAME), manifest_bytes, content_type="application/json", sha256=manifest_sha256
        )
        log.info(
            "saved version %d: %d shard(s), %d bytes, %s", version, len(shards), manifest.size_bytes, manifest.dtype
        )
        return ModelVersion(
            version=version,
            uri=entry_uri,
            sha256=entry_sha256,
            manifest_uri=manifest_info.uri,
            manifest_sha256=manifest_sha256,
            shards=len(shards),
            size_bytes=manifest.size_bytes,
            trainer_step=trainer_step,
            base_model=base_model,
            created_at=created_at,
        )

    def read(self, announced: ModelVersion) -> dict[str, torch.Tensor]:
        """The tensors of a version this publisher's run announced, read back from the store (blocking): its
        manifest checked against the announcement's digest, each shard against the manifest's.

        Raises:
            CheckpointError: The manifest or a shard is missing, changed, or not this version's.
        """
        from safetensors.torch import load

        where = self.key(announced.version, MANIFEST_NAME)
        try:
            raw = self.store.get(where)
        except StoreError as exc:
            raise CheckpointError(where, f"published version {announced.version} cannot be read: {exc}") from exc
        if announced.manifest_sha256 is not None and hashlib.sha256(raw).hexdigest() != announced.manifest_sha256:
            raise CheckpointError(where, "the manifest is not the one announced (its sha256 differs)")
        manifest = WeightManifest.model_validate_json(raw)
        if manifest.version != announced.version:
            raise CheckpointError(where, f"describes version {manifest.version}, not {announced.version}")
        weights: dict[str, torch.Tensor] = {}
        for shard in manifest.shards:
            key = self.key(announced.version, shard.name)
            try:
                data = self.store.get(key)
            except StoreError as exc:
                raise CheckpointError(key, f"a shard of version {announced.version} cannot be read: {exc}") from exc
            if hashlib.sha256(data).hexdigest() != shard.sha256:
                raise CheckpointError(key, "the shard is not the one the manifest names (its sha256 differs)")
            weights.update(load(data))
        return weights

    def _write_shards(
        self,
        weights: dict[str, torch.Tensor],
        version: int,
        plan: list[list[str]],
        dtype: torch.dtype | None,
        metadata: dict[str, str],
    ) -> list[WeightShard]:
        """Stream each planned shard into the store, ``publish.concurrency`` at a time; their records."""

        def write(i: int, names: list[str]) -> WeightShard:
            name = shard_name(i, len(plan))
            stream = shard_stream(weights, names, dtype, metadata)
            # Hashed here as the bytes stream into the store, and recorded in the manifest (the record of
            # a version's digests). The store is not asked to record it: an S3 store can attach a digest
            # known only after the upload by a server-side copy of the whole object, a second write.
            digest = hashlib.sha256()
            info = self.store.put_stream(
                self.key(version, name),
                _hashed(stream.chunks, digest),
                size=stream.size,
                content_type="application/octet-stream",
                sha256=False,
            )
            return WeightShard(name=name, uri=info.uri, size_bytes=info.size, sha256=digest.hexdigest())

        workers = min(self.config.concurrency, len(plan))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="publish") as pool:
            return list(pool.map(write, range(1, len(plan) + 1), plan))

    def _write_index(self, version: int, plan: list[list[str]], shards: list[WeightShard]) -> tuple[str, str]:
        """Write a sharded version's index (tensor name -> shard); its uri and sha256."""
        index = {
            "metadata": {"total_size": sum(s.size_bytes for s in shards), "dart_version": str(version)},
            "weight_map": {n: shard_name(i, len(plan)) for i, names in enumerate(plan, 1) for n in names},
        }
        info = self.store.put(
            self.key(version, INDEX_NAME), json.dumps(index, indent=2).encode(), content_type="application/json"
        )
        assert info.sha256 is not None
        return info.uri, info.sha256

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
        await retry(
            lambda: self._announce_once(model),
            backoff=Backoff(0.5, max_s=5.0),
            timeout_s=self.announce_retry_s,
            retryable=lambda exc: isinstance(exc, JetStreamError),
            what=f"announcing version {model.version}",
            logger=log,
        )
        self.last = model

    async def _announce_once(self, model: ModelVersion) -> None:
        if self.bus is not None:
            subject = self.bus.subjects.stream_subject("model")
            await self.bus.js_publish(subject, model, msg_id=f"model-v{model.version}")
        if self.state is not None:
            await self.state.put(LATEST_MODEL_KEY, model)

    async def publish(
        self,
        weights: dict[str, torch.Tensor],
        version: int,
        *,
        trainer_step: int,
        base_model: str,
        adapter: AdapterSpec | None = None,
    ) -> ModelVersion:
        """Save (in a worker thread) and announce a version; returns its :class:`ModelVersion`."""
        model = await asyncio.to_thread(
            self.save, weights, version, trainer_step=trainer_step, base_model=base_model, adapter=adapter
        )
        await self.announce(model)
        return model


def _hashed(chunks: Iterator[bytes], digest: hashlib._Hash) -> Iterator[bytes]:
    for chunk in chunks:
        digest.update(chunk)
        yield chunk


def weights_file(model: ModelVersion) -> Path:
    """Local path of a ``file://`` version (what an engine's ``update_weights`` takes on one machine): the
    file of a one-shard version, the directory of a sharded one."""
    from dart.runtime.store import parse_uri

    path = Path(os.fspath(parse_uri(model.uri).path))
    return path.parent if model.shards > 1 else path
