"""The one place where messages become bytes and bytes become messages.

The wire form is a message's JSON; above :data:`COMPRESS_ABOVE_BYTES` it travels xz-compressed (an xz stream, which
its magic bytes tell from JSON). A real-size step sequence is what makes this pay: each step records the exact
prompt tokens the engine consumed, so a 1920x1080 screen is 2,691 identical image-pad ids and every step repeats the
earlier steps' history. Such a 20-step episode of random 128-token answers, 1.4 MB of JSON, compresses 28-fold and
its group's training batch 35-fold (``benchmarks/wire_bytes.py``), so trajectories and batches stay far inside the
bus's message limit without changing what a step records. xz and not zlib: its dictionary spans the whole message,
so a step's repeat of the step before (hundreds of kilobytes back) is found; zlib's 32 KiB window finds only the
runs within a step.

Every receiver decodes through :func:`decode`, so any malformed input (bad UTF-8, bad JSON, a corrupt or
truncated xz stream, one that expands beyond :data:`MAX_DECODED_BYTES`, a schema violation, a wrong
``kind``) surfaces as exactly one exception type, :class:`~dart.protocol.errors.MessageValidationError`,
which services turn into a typed error reply instead of crashing.
"""

from __future__ import annotations

import lzma
from typing import Any, TypeVar, overload

from pydantic import BaseModel, TypeAdapter, ValidationError

from dart.protocol.errors import MessageValidationError
from dart.protocol.messages.base import Message

M = TypeVar("M", bound=BaseModel)


COMPRESS_ABOVE_BYTES = 32 * 1024
"""Messages whose JSON is longer travel xz-compressed; shorter ones stay plain JSON (readable on the bus)."""
MAX_DECODED_BYTES = 512 * 1024 * 1024
"""The most JSON a compressed message may expand to: a larger one is refused, not decompressed."""
XZ_MAGIC = b"\xfd7zXZ\x00"
"""The first bytes of an xz stream (JSON never starts with 0xfd)."""


def encode(msg: Message) -> bytes:
    """Serialize a message to its wire form: its JSON, xz-compressed above :data:`COMPRESS_ABOVE_BYTES`."""
    return pack(to_json(msg))


def to_json(msg: Message) -> bytes:
    """A message's JSON (its wire form when small: :func:`pack` it)."""
    return msg.model_dump_json().encode()


def pack(data: bytes) -> bytes:
    """A message's JSON as it travels: xz-compressed when longer than :data:`COMPRESS_ABOVE_BYTES` and the
    compression is shorter, else as it is. Takes about 10 ms per MB of a real trajectory's JSON and
    over 100 ms per MB of data that does not compress (an async caller runs a large one in a thread)."""
    if len(data) <= COMPRESS_ABOVE_BYTES:
        return data
    packed = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32, preset=1)
    return packed if len(packed) < len(data) else data


def wire_json(data: bytes | bytearray | memoryview | str) -> bytes | str:
    """The JSON of a wire message: ``data`` itself, or its decompression when it is an xz stream.

    Raises:
        ValueError: A corrupt or truncated xz stream, trailing bytes after it, or JSON longer than
            :data:`MAX_DECODED_BYTES`.
    """
    raw = bytes(data) if isinstance(data, bytearray | memoryview) else data
    if isinstance(raw, str) or not raw.startswith(XZ_MAGIC):
        return raw
    unpacker = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        out = unpacker.decompress(raw, max_length=MAX_DECODED_BYTES + 1)
    except lzma.LZMAError as exc:
        raise ValueError(f"corrupt compressed message: {exc}") from None
    if len(out) > MAX_DECODED_BYTES:
        raise ValueError(f"compressed message expands beyond {MAX_DECODED_BYTES} bytes")
    if not unpacker.eof:
        raise ValueError("truncated compressed message")
    if unpacker.unused_data:
        raise ValueError(f"{len(unpacker.unused_data)} bytes after the compressed message")
    return out


@overload
def decode(data: bytes | bytearray | memoryview | str, schema: type[M]) -> M: ...
@overload
def decode(data: bytes | bytearray | memoryview | str, schema: TypeAdapter[Any]) -> Any: ...
def decode(data: bytes | bytearray | memoryview | str, schema: type[M] | TypeAdapter[Any]) -> Any:
    """Parse and validate wire bytes against a message class or a union adapter.

    Args:
        data: The wire bytes (or JSON text) as received: JSON, or JSON xz-compressed.
        schema: A :class:`Message` subclass, or a ``TypeAdapter`` over a discriminated union.

    Returns:
        The validated message.

    Raises:
        MessageValidationError: The input is not valid JSON or does not match the schema. No other
            exception escapes, whatever the input.
    """
    name = _schema_name(schema)
    try:
        raw = wire_json(data)
        if isinstance(schema, TypeAdapter):
            return schema.validate_json(raw)
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        errors = [
            {"loc": ".".join(str(p) for p in err.get("loc", ())), "type": err.get("type"), "msg": err.get("msg")}
            for err in exc.errors(include_url=False, include_input=False)
        ]
        summary = "; ".join(f"{e['loc'] or '<root>'}: {e['msg']}" for e in errors[:5])
        raise MessageValidationError(name, summary or str(exc), errors) from None
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise MessageValidationError(name, f"{type(exc).__name__}: {exc}") from None


def _schema_name(schema: type[BaseModel] | TypeAdapter[Any]) -> str:
    if isinstance(schema, TypeAdapter):
        return str(getattr(schema, "_type", "union"))
    return schema.__name__
