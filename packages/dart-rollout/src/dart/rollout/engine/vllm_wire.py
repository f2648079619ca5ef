"""What the vllm engine sends and checks: chat messages from DART prompts, safetensors headers, weight dirs."""

from __future__ import annotations

import base64
import io
import json
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


def weights_dir(directory: Path, path: Path) -> Path:
    """``directory`` holding a link to ``path``: vLLM reloads from a directory of safetensors files."""
    directory.mkdir(exist_ok=True)
    link = directory / "model.safetensors"
    link.unlink(missing_ok=True)
    link.symlink_to(path.resolve())
    return directory
