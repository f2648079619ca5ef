"""What the vllm engine sends and checks: chat messages from DART prompts, safetensors headers, staged weights.

Weights are a safetensors file or a directory of shards with their index (:mod:`dart.protocol.weights`).
"""

from __future__ import annotations

import base64
import errno
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

from dart.policy.prompt import IMAGE_PLACEHOLDER, ChatPrompt
from dart.protocol.weights import INDEX_NAME, WEIGHTS_NAME, read_safetensors_header, shard_files

_NAME_FORMS = (("model.language_model.", "model."), ("model.visual.", "visual."))
"""transformers' module names (what the trainer publishes) -> checkpoint names (what ``save_pretrained``
writes); vLLM loads both, so weights are compared in one form."""


def checkpoint_name(name: str) -> str:
    for module_prefix, checkpoint_prefix in _NAME_FORMS:
        if name.startswith(module_prefix):
            return checkpoint_prefix + name[len(module_prefix) :]
    return name


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name (checkpoint form) -> (dtype, shape) from a ``.safetensors`` header (tensors are not read)."""
    header = read_safetensors_header(path)
    return {checkpoint_name(k): (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def reference_header(checkpoint: Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """What published weights must match for the checkpoint a server started from (names in checkpoint
    form), or None when it is not one ``model.safetensors``.

    A checkpoint of a model with tied embeddings stores the shared matrix once, as the embedding;
    published weights carry the head too, as its own copy (vLLM's in-place reload loads the head from
    the file), so the head is expected under its own name with the embedding's dtype and shape.
    """
    weights = checkpoint / "model.safetensors"
    if not weights.is_file():
        return None
    header = safetensors_header(weights)
    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    text = config.get("text_config") or {}
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    if tied and TIED_HEAD not in header and TIED_EMBEDDING in header:
        header[TIED_HEAD] = header[TIED_EMBEDDING]
    return header


def _png_data_url(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def chat_messages(prompt: ChatPrompt) -> list[dict[str, Any]]:
    """One user message whose parts, rendered by the pass-through template, give exactly ``prompt.text``."""
    pieces = prompt.text.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != len(prompt.images):
        raise ValueError(f"prompt has {len(pieces) - 1} placeholders for {len(prompt.images)} images")
    content: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if piece:
            content.append({"type": "text", "text": piece})
        if i < len(prompt.images):
            content.append({"type": "image_url", "image_url": {"url": _png_data_url(prompt.images[i])}})
    return [{"role": "user", "content": content}]


def weights_header(weights: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """:func:`safetensors_header` of every shard of ``weights`` (a file, or a directory of shards and index).

    Raises:
        ValueError: A tensor is in two shards, or the directory holds no weights.
        OSError: A shard is unreadable.
    """
    merged: dict[str, tuple[str, tuple[int, ...]]] = {}
    for shard in shard_files(weights):
        header = safetensors_header(shard)
        repeated = sorted(set(header) & set(merged))
        if repeated:
            raise ValueError(f"{shard.name} repeats tensors of another shard: {repeated[:5]}")
        merged |= header
    return merged


def stage_weights(directory: Path, weights: Path) -> Path:
    """``directory`` holding ``weights``' bytes, as vLLM reloads them: a file as ``model.safetensors``, a
    directory of shards as its shards and ``model.safetensors.index.json``.

    A hard link where ``directory`` and ``weights`` share a filesystem, else a copy: never a symbolic
    link, because the artifact store's retention may delete ``weights`` while the server still needs
    them (loading them, or reloading them after a restart), and a hard link keeps the bytes alive.

    Raises:
        OSError: ``weights`` is gone or unreadable, or ``directory`` cannot be written.
        ValueError: A directory without shards, or with an index naming files outside it.
    """
    if weights.is_dir():
        sources = shard_files(weights)
        if (weights / INDEX_NAME).is_file():
            sources.append(weights / INDEX_NAME)
        staged = {source.name: source for source in sources}
    else:
        staged = {WEIGHTS_NAME: weights}
    directory.mkdir(parents=True, exist_ok=True)
    for name, source in staged.items():
        link_or_copy(source, directory / name)
    # Restaged over an earlier attempt of another layout: only what was just staged may be read.
    for stale in directory.iterdir():
        if stale.name not in staged and (stale.name == INDEX_NAME or stale.suffix == ".safetensors"):
            stale.unlink()
    return directory


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` holding ``source``'s bytes: a hard link, or a copy across filesystems (never a symbolic link:
    see :func:`stage_weights`)."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copyfile(source, target)
