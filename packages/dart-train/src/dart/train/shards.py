"""Safetensors shards produced as a byte stream, so the store hashes them while they are written.

:func:`plan_shards` splits a state dict into shards of at most ``max_bytes`` of tensor data (in order, as
``save_pretrained`` does: a tensor larger than the limit gets a shard of its own); :func:`shard_stream`
gives one shard's size and its bytes in the safetensors format (8-byte little-endian header length, JSON
header padded to 8 bytes, tensor data in header order). Nothing is staged on disk and no shard is read
back: the artifact store's ``put_stream`` computes the sha256 of the bytes as they pass.

Names whose tensors share memory (tied embeddings) are each written with their own bytes, so engines
that load every name from the file (vLLM's in-place reload) get the head too (see :mod:`dart.train.tied`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

_CHUNK = 16 * 1024 * 1024
"""Bytes per chunk handed to the store: bounds the memory of a streamed tensor to one chunk's copy."""

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def published_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` is published in: ``dtype`` for floating-point tensors, its own otherwise."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def plan_shards(weights: Mapping[str, torch.Tensor], max_bytes: int, dtype: torch.dtype | None) -> list[list[str]]:
    """Tensor names per shard, in ``weights``' order, each shard holding at most ``max_bytes`` of data."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * published_dtype(tensor, dtype).itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


@dataclass(frozen=True)
class ShardStream:
    """One shard as bytes to stream.

    Attributes:
        size: Bytes ``chunks`` yields in all.
        chunks: The file's bytes, header first; each chunk at most 16 MiB.
    """

    size: int
    chunks: Iterator[bytes]


def shard_stream(
    weights: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype | None, metadata: dict[str, str]
) -> ShardStream:
    """The safetensors bytes of ``names`` from ``weights`` (CPU tensors), floating ones cast to ``dtype``.

    Raises:
        ValueError: A tensor is of a dtype safetensors has no name for, or not on the CPU.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        tensor = weights[name]
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor {name} is on {tensor.device}: publish CPU tensors")
        target = published_dtype(tensor, dtype)
        if target not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name} has dtype {target}, which safetensors cannot store")
        nbytes = tensor.numel() * target.itemsize
        header[name] = {
            "dtype": _DTYPE_NAMES[target],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    head = len(encoded).to_bytes(8, "little") + encoded
    return ShardStream(len(head) + offset, _chunks(head, weights, names, dtype))


def _chunks(
    head: bytes, weights: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype | None
) -> Iterator[bytes]:
    yield head
    for name in names:
        tensor = weights[name]
        # One tensor at a time is cast and made contiguous: memory stays one tensor beyond the weights.
        data = tensor.detach().to(published_dtype(tensor, dtype)).contiguous().reshape(-1)
        raw = data.view(torch.uint8).numpy().data
        for start in range(0, len(raw), _CHUNK):
            yield bytes(raw[start : start + _CHUNK])
