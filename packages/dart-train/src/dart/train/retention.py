"""Bounded storage: which published weight versions and checkpoints to delete.

Weights: keep the newest ``keep_last`` versions and every version divisible by ``keep_every``;
delete the rest under ``<prefix>/v<n>/``. Why deleting beyond ``keep_last >= 2`` of the newest
never pulls weights from under an engine: engines only ever load the version announced as latest
(the KV's ``latest_model``), and the rollout sync controller starts an update only for that
version, on at most ``max_updating_fraction`` of the engines at a time. An engine loading version
n-1 when n is announced keeps it for as long as it takes the trainer to train and publish
``keep_last - 1`` more versions (a full train step each); a load that slow has failed anyway and is
retried on the newest version. The announced version itself is always the newest, so it is kept.

Checkpoints: keep the newest ``checkpoint_keep_last`` ``step-<n>`` directories.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from dart.runtime.store import ArtifactStore
from dart.train.config import RetentionConfig

_VERSION = re.compile(r"^v(\d+)$")
_STEP = re.compile(r"^step-(\d+)$")


def published_versions(store: ArtifactStore, prefix: str) -> list[int]:
    """Weight versions present under ``<prefix>/``, ascending."""
    versions = set()
    for info in store.list(f"{prefix}/"):
        match = _VERSION.match(info.key[len(prefix) + 1 :].split("/", 1)[0])
        if match:
            versions.add(int(match.group(1)))
    return sorted(versions)


def versions_to_delete(versions: list[int], newest: int, retention: RetentionConfig) -> list[int]:
    """The versions retention deletes once ``newest`` is published (never ``newest`` or above)."""
    return [
        v
        for v in versions
        if v <= newest - retention.keep_last and not (retention.keep_every and v % retention.keep_every == 0)
    ]


def prune_weights(store: ArtifactStore, prefix: str, newest: int, retention: RetentionConfig) -> list[int]:
    """Delete the weight versions retention does not keep (blocking); returns them."""
    doomed = versions_to_delete(published_versions(store, prefix), newest, retention)
    for version in doomed:
        for info in list(store.list(f"{prefix}/v{version}/")):
            store.delete(info.key)
    return doomed


def prune_checkpoints(directory: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` ``step-<n>`` checkpoints under ``directory``; returns them."""
    root = Path(directory)
    steps = sorted((int(m.group(1)), p) for p in root.glob("step-*") if (m := _STEP.match(p.name)) and p.is_dir())
    doomed = [p for _, p in steps[: max(0, len(steps) - keep_last)]]
    for path in doomed:
        shutil.rmtree(path)
    return doomed
