"""The one place where messages become bytes and bytes become messages.

Every receiver decodes through :func:`decode`, so any malformed input (bad UTF-8, bad JSON, a
schema violation, a wrong ``kind``) surfaces as exactly one exception type,
:class:`~dart.protocol.errors.MessageValidationError`, which services turn into a typed error
reply instead of crashing.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from pydantic import BaseModel, TypeAdapter, ValidationError

from dart.protocol.errors import MessageValidationError
from dart.protocol.messages.base import Message

M = TypeVar("M", bound=BaseModel)


def encode(msg: Message) -> bytes:
    """Serialize a message to its JSON wire form."""
    return msg.model_dump_json().encode()


@overload
def decode(data: bytes | bytearray | memoryview | str, schema: type[M]) -> M: ...
@overload
def decode(data: bytes | bytearray | memoryview | str, schema: TypeAdapter[Any]) -> Any: ...
def decode(data: bytes | bytearray | memoryview | str, schema: type[M] | TypeAdapter[Any]) -> Any:
    """Parse and validate wire bytes against a message class or a union adapter.

    Args:
        data: JSON bytes (or text) as received.
        schema: A :class:`Message` subclass, or a ``TypeAdapter`` over a discriminated union.

    Returns:
        The validated message.

    Raises:
        MessageValidationError: The input is not valid JSON or does not match the schema. No other
            exception escapes, whatever the input.
    """
    name = _schema_name(schema)
    try:
        raw = bytes(data) if isinstance(data, bytearray | memoryview) else data
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
