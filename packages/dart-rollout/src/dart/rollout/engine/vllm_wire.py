"""What the vllm engine sends and checks: chat messages from DART prompts, safetensors headers, staged weights."""

from __future__ import annotations

import base64
import errno
import io
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

from dart.rollout.model.prompt import IMAGE_PLACEHOLDER, ChatPrompt

_NAME_FORMS = (("model.language_model.", "model."), ("model.visual.", "visual."))
"""transformers' module names (what the trainer publishes) -> checkpoint names (what ``save_pretrained``
writes); vLLM loads both, so weights are compared in one form."""


def _checkpoint_name(name: str) -> str:
    for module_prefix, checkpoint_prefix in _NAME_FORMS:
        if name.startswith(module_prefix):
            return checkpoint_prefix + name[len(module_prefix) :]
    return name


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name (checkpoint form) -> (dtype, shape) from a ``.safetensors`` header (tensors are not read)."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {_checkpoint_name(k): (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


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


def stage_weights(directory: Path, path: Path) -> Path:
    """``directory`` holding ``path``'s bytes as ``model.safetensors`` (vLLM reloads from a directory).

    A hard link where ``directory`` and ``path`` share a filesystem, else a copy: never a symbolic
    link, because the artifact store's retention may delete ``path`` while the server still needs the
    weights (loading them, or reloading them after a restart), and a hard link keeps the bytes alive.

    Raises:
        OSError: ``path`` is gone or unreadable, or ``directory`` cannot be written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    staged = directory / "model.safetensors"
    staged.unlink(missing_ok=True)
    try:
        os.link(path, staged)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copyfile(path, staged)
    return directory
