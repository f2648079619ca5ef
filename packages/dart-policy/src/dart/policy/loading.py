"""Load a policy and its processor from a local directory, never from a hub, with its model family's class."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

# transformers resolves its lazy attributes on first import; two engines loading in two threads at
# once can see a half-initialized module ("cannot import name 'AutoProcessor'"), so loads take turns.
_LOAD_LOCK = threading.Lock()


def load_policy(path: str | Path, *, dtype: Any = None, device: str = "cpu") -> tuple[Any, Any]:
    """Load ``(model, processor)`` from a local checkpoint directory.

    Args:
        path: Directory written by ``save_pretrained`` (e.g. by :func:`dart.policy.tiny.write_tiny_checkpoint`).
        dtype: Torch dtype of the weights; float32 when None (exact log-probs on CPU).
        device: Torch device to place the model on.

    Raises:
        FileNotFoundError: ``path`` is not a directory holding ``config.json``.
        ConfigError: The checkpoint's ``model_type`` belongs to no registered model family.
    """
    with _LOAD_LOCK:
        return _load(Path(path), dtype, device)


def load_tokenizer(path: str | Path) -> Any:
    """Load the tokenizer of a local checkpoint directory (no model, no image processor).

    Raises:
        FileNotFoundError: ``path`` is not a directory holding ``tokenizer_config.json``.
    """
    local = Path(path)
    if not (local / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no tokenizer at {local}: expected {local / 'tokenizer_config.json'}")
    with _LOAD_LOCK:
        from transformers import AutoTokenizer

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return AutoTokenizer.from_pretrained(local, local_files_only=True)


def _load(local: Path, dtype: Any, device: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoProcessor

    from dart.policy.models import family_of

    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {local}: expected {local / 'config.json'}; write one first")
    family = family_of(local)
    # A local path never needs the hub; make sure nothing tries to reach it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    processor = AutoProcessor.from_pretrained(local, local_files_only=True)  # type: ignore[no-untyped-call]  # an unannotated transformers API
    model = family.model_cls().from_pretrained(local, local_files_only=True, dtype=dtype or torch.float32)
    model.to(device).eval()
    return model, processor
