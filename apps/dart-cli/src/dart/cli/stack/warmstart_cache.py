"""A cache of warm-started policies, keyed by everything that determines one.

A warm start (oracle demonstrations, then SFT) is deterministic given its inputs, and several runs of
one configuration family (a smoke run and its FSDP, megatron and vLLM variants; repeated quickstarts)
warm-start the same policy. The key is a SHA-256 over: the model source (tiny seed, or the checkpoint's
path and file sizes and times), the suite's tasks, the env section, the prompt settings the demos are
tokenized with, the warm-start and SFT-relevant trainer settings, the run seed, and the versions of
DART, torch and transformers. What cannot change the policy stays out of it: trainer backend and
parallelism, RL settings, data curation, the run's name and durations, the warm start's time limits
(``max_seconds``, ``max_slowdown``, ``guard_floor_s``: only complete warm starts are stored, so no limit cut a
cached one short).

Entries are directories ``<cache_dir>/<key>/`` holding the checkpoint (``policy/``) and the warm
start's figures (``info.json``); an entry is written under a temporary name and renamed into place,
so a reader sees a whole entry or none, and two runs filling the same key concurrently both succeed.
Runs on one host that want the same key at once warm-start it once: :meth:`WarmStartCache.filling` holds
an exclusive lock on ``<cache_dir>/.<key>.lock`` while one of them looks the key up and fills it, and the
others find the entry when they get the lock (or fill it themselves, when the first was cut short).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dart.cli.stack.config import RunConfig
from dart.protocol.messages import TaskSpec

_NOT_KEYED = frozenset({"max_seconds", "max_slowdown", "guard_floor_s", "cache_dir", "threads"})
"""Warm-start settings that cannot change a complete warm start."""

_TRAIN_FIELDS_OUTSIDE_KEY = frozenset(
    {
        "backend",
        "model_path",
        "num_threads",
        "checkpoint_dir",
        "checkpoint_every",
        "publish_every",
        "retention",
        "weights_prefix",
        "lr",  # warm start uses warm_start.lr
        "debug_step_delay_s",  # RL steps only
        "lora",  # the warm start trains every weight; LoRA applies to RL after it
        # Throughput levers: each changes the warm start's steps by rounding at most, as num_threads does.
        "packing",
        "activation_checkpointing",
        "optimizer_impl",
        "logprob_micro_batch_size",  # RL's passes without gradient only
    }
)
"""Trainer settings that cannot change a warm start beyond rounding (it always runs on the single-process torch
backend)."""

_FORMAT = 1
"""Bumped when an entry's layout or the key's composition changes."""


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _model_source(config: RunConfig) -> dict[str, Any]:
    if config.model.path is None:
        return {"tiny_seed": config.model.tiny_seed, "family": config.model.family}
    root = config.model.path.resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {
        "path": str(root),
        "files": [(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in files],
    }


def warm_start_key(config: RunConfig, tasks: list[TaskSpec]) -> str:
    """SHA-256 (hex) of everything that determines the warm-started policy of ``config``."""
    material = {
        "format": _FORMAT,
        "model": _model_source(config),
        "tasks": [t.model_dump(mode="json") for t in tasks],
        "env": config.env.model_dump(mode="json"),
        "prompt": config.rollout.runner.prompt.model_dump(mode="json"),
        "warm_start": config.warm_start.model_dump(mode="json", exclude=set(_NOT_KEYED)),
        "train": config.train.model_dump(mode="json", exclude=set(_TRAIN_FIELDS_OUTSIDE_KEY)),
        "seed": config.run.seed,
        "versions": {p: _version(p) for p in ("dart-cli", "dart-train", "dart-env", "torch", "transformers")},
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


class WarmStartCache:
    """Warm-started policies under ``root``, one directory per key."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @contextlib.contextmanager
    def filling(self, key: str) -> Iterator[None]:
        """Hold the key's lock (blocking until no other process on this host holds it): look up, compute
        and :meth:`put` inside it, so concurrent runs wanting the same warm start compute it once."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f".{key}.lock", "wb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
            yield

    def get(self, key: str, out: Path) -> dict[str, Any] | None:
        """Copy the entry's policy to ``out`` and return its figures, or None when there is no entry."""
        entry = self.root / key
        if not (entry / "info.json").is_file():
            return None
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(entry / "policy", out)
        info: dict[str, Any] = json.loads((entry / "info.json").read_text())
        return info

    def put(self, key: str, policy: Path, info: dict[str, Any]) -> None:
        """Store ``policy`` (a checkpoint directory) and ``info`` under ``key``; an existing entry stays."""
        entry = self.root / key
        if entry.exists():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".{key}.{uuid.uuid4().hex}"
        try:
            shutil.copytree(policy, staging / "policy")
            (staging / "info.json").write_text(json.dumps(info, sort_keys=True))
            try:
                os.rename(staging, entry)
            except OSError:
                if not entry.exists():  # not a concurrent writer that got there first
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
