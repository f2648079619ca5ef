"""A random-weight checkpoint of a published architecture of any registered family, with a local tokenizer.

No hub is reachable from DART's machines, so real-size checkpoints are written locally: the sizes of
:mod:`dart.policy.architectures` (Qwen2.5-VL and Qwen3-VL, optionally cut to fewer layers / vision
blocks), random weights in the target dtype, the tokenizer of :mod:`dart.policy.tiny` trained on
the action grammar but with Qwen's special-token ids (``<|endoftext|>`` 151643 ... ``<|image_pad|>``
151655, ``<|video_pad|>`` 151656) and the published image processor settings. It loads with its family's
class and ``AutoProcessor.from_pretrained`` like a downloaded checkpoint.

Memory: the model is built once, directly in the target dtype (no float32 copy): about 2 bytes per
parameter in bfloat16. Qwen2.5-VL-3B cut to 2 layers and 2 vision blocks is 0.54 B parameters (the
151,936 x 2048 tied embedding is 0.31 B of them), 1.1 GB on disk, written in 29 s with 2.6 GB peak RSS
(2-core CPU machine, 2026-11-26).

Usage::

    arch = get_architecture("qwen2.5-vl-3b").cut(layers=2, vision_blocks=2)
    manifest = write_checkpoint("/tmp/qwen3b-2l", arch, dtype="bfloat16")
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from dart.policy.families import FIRST_SPECIAL_ID, RealArchitecture
from dart.policy.tiny import (
    DEFAULT_INSTRUCTIONS,
    SPECIAL_TOKENS,
    build_tokenizer,
    tokenizer_corpus,
)
from dart.policy.tiny_spec import TinyModelSpec

MANIFEST_NAME = "dart_init_manifest.json"

Dtype = Literal["bfloat16", "float32"]

MAX_SHARD_SIZE = "2GB"
"""safetensors shard size: real checkpoints are sharded, so loaders are exercised on an index file."""


@dataclass(frozen=True)
class CheckpointManifest:
    """What :func:`write_checkpoint` wrote (also stored as ``dart_init_manifest.json``).

    Attributes:
        path: Checkpoint directory.
        architecture: The architecture's name (e.g. ``qwen2.5-vl-3b``).
        model_class: The transformers class to load the weights with.
        dtype: Weight dtype on disk.
        transformers_version: Version that wrote the checkpoint.
        seed: Seed of the random weights and the tokenizer's synthetic corpus.
        num_parameters: Total parameter count (tied embeddings counted once).
        vocab_size: Embedding rows.
        tokenizer_size: Tokens the tokenizer knows (trained, reserved and special).
        spec: The sizes written (the architecture after any cut).
        created_at: Unix time of creation, seconds.
    """

    path: str
    architecture: str
    model_class: str
    dtype: str
    transformers_version: str
    seed: int
    num_parameters: int
    vocab_size: int
    tokenizer_size: int
    spec: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0


def write_checkpoint(
    path: str | Path,
    arch: RealArchitecture,
    *,
    dtype: Dtype = "bfloat16",
    seed: int = 0,
    vocab_texts: Sequence[str] | None = None,
) -> CheckpointManifest:
    """Write a random checkpoint of ``arch`` (config, sharded safetensors, tokenizer, processor, manifest).

    Args:
        path: Directory to write (created; existing files are overwritten).
        arch: Sizes, e.g. ``get_architecture("qwen2.5-vl-3b").cut(layers=2, vision_blocks=2)``.
        dtype: Weight dtype; the model is built in it (never in float32 first).
        seed: Seed of the weights and the tokenizer corpus.
        vocab_texts: Instruction texts the tokenizer is trained on besides the action grammar;
            defaults to :data:`~dart.policy.tiny.DEFAULT_INSTRUCTIONS`.

    Returns:
        The manifest, also written to ``path/dart_init_manifest.json``.
    """
    import torch
    import transformers

    from dart.policy.models import MODEL_FAMILIES

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(
        tokenizer_corpus(vocab_texts if vocab_texts is not None else DEFAULT_INSTRUCTIONS, seed=seed),
        TinyModelSpec().bpe_vocab_size,
        first_special_id=FIRST_SPECIAL_ID,
    )
    ids = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS}
    config = arch.config(ids)
    model_cls = MODEL_FAMILIES.get(arch.family).model_cls()
    torch.manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    # _from_config builds every module with ``dtype`` as the default dtype: the weights exist once, in
    # the target dtype, and are initialized in place (a 3B model in float32 first would need 15 GB).
    model = model_cls._from_config(config, dtype=torch_dtype).eval()
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out, max_shard_size=MAX_SHARD_SIZE)
    num_parameters = sum(p.numel() for p in model.parameters())  # parameters() yields a tied matrix once
    del model
    arch.processor(tokenizer).save_pretrained(out)

    manifest = CheckpointManifest(
        path=str(out),
        architecture=arch.name,
        model_class=model_cls.__name__,
        dtype=dtype,
        transformers_version=transformers.__version__,
        seed=seed,
        num_parameters=num_parameters,
        vocab_size=arch.vocab_size,
        tokenizer_size=len(tokenizer),
        spec=asdict(arch),  # type: ignore[call-overload]  # every family's architecture is a dataclass
        created_at=time.time(),
    )
    (out / MANIFEST_NAME).write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    return manifest
