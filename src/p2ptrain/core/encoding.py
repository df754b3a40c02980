"""Canonical encoding of records and their ids.

Records are frozen msgspec Structs. Their canonical form is msgpack with the Struct's fields
in declaration order and dict keys sorted (``order="deterministic"``). An id is the lowercase
hex SHA-256 of that canonical form.

Decoding is the boundary where peer bytes enter: :func:`decode` enforces a maximum size,
decodes into the exact type (which runs each record's validation), and then insists that
the bytes were *canonical* -- re-encoding the value gives back exactly the input. Any failure
raises :class:`~p2ptrain.errors.ProtocolViolation` and nothing else.
"""

from __future__ import annotations

import hashlib
from typing import Any, TypeVar

import msgspec

from p2ptrain.errors import ProtocolViolation

T = TypeVar("T")

#: Default ceiling on one encoded record. Decoders always take an explicit or default maximum.
DEFAULT_MAX_RECORD_BYTES = 1 << 20

_ENCODER = msgspec.msgpack.Encoder(order="deterministic")
_DECODERS: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}

#: Exceptions that decoding peer bytes may raise inside msgspec or a record's validation.
#: Everything here becomes a ProtocolViolation at the boundary.
DECODE_FAILURES: tuple[type[BaseException], ...] = (
    msgspec.DecodeError,
    msgspec.ValidationError,
    ValueError,
    TypeError,
    OverflowError,
    UnicodeError,
    RecursionError,
)


def encode(value: Any) -> bytes:
    """Return the canonical msgpack encoding of ``value``."""
    return _ENCODER.encode(value)


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    """Lowercase hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def record_id(value: Any) -> str:
    """The id of a record: SHA-256 hex of its canonical encoding."""
    return sha256_hex(encode(value))


def _decoder_for(kind: type[T]) -> msgspec.msgpack.Decoder[T]:
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = msgspec.msgpack.Decoder(kind)
        _DECODERS[kind] = decoder
    return decoder


def decode(kind: type[T], data: bytes | bytearray | memoryview, *, max_bytes: int) -> T:
    """Decode canonical bytes into ``kind``, or raise :class:`ProtocolViolation`.

    ``max_bytes`` is required: every decoder in p2ptrain has a ceiling.
    """
    name = getattr(kind, "__name__", str(kind))
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolViolation(f"{name}: expected bytes, got {type(data).__name__}")
    size = len(data)
    if size > max_bytes:
        raise ProtocolViolation(f"{name}: {size} bytes exceeds the limit of {max_bytes} bytes")
    try:
        value = _decoder_for(kind).decode(data)
        canonical = encode(value)
    except DECODE_FAILURES as exc:
        raise ProtocolViolation(f"{name}: cannot decode: {exc}") from exc
    if canonical != data:
        raise ProtocolViolation(f"{name}: encoding is not canonical")
    return value
