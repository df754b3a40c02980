"""Checks shared by record validation; each raises InvalidRecord naming the field."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

from p2ptrain.core.identity import PUBLIC_KEY_BYTES
from p2ptrain.errors import InvalidRecord

_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")

MAX_NAME_CHARS = 128
MAX_TEXT_CHARS = 1024
MAX_ADDRESS_CHARS = 256


def name_from(text: str, *, limit: int, fallback: str) -> str:
    """``text`` made into a name :func:`check_name` accepts: other than ASCII letters,
    digits, '.', '_' and '-' becomes '-', leading and trailing separators go, at most
    ``limit`` characters (``fallback`` when nothing is left)."""
    kept = "".join(c if (c.isascii() and c.isalnum()) or c in "._-" else "-" for c in text)
    return (kept.strip("._-") or fallback)[:limit]


def check_hex_id(field: str, value: str) -> None:
    """A SHA-256 id: exactly 64 lowercase hex characters."""
    if not _HEX64.fullmatch(value):
        raise InvalidRecord(
            field, f"must be 64 lowercase hex characters (a SHA-256), got {value!r:.80}"
        )


def check_optional_hex_id(field: str, value: str | None) -> None:
    if value is not None:
        check_hex_id(field, value)


def check_name(field: str, value: str) -> None:
    """A short identifier: letters, digits, '.', '_' and '-', starting alphanumeric."""
    if not 0 < len(value) <= MAX_NAME_CHARS or not _NAME.fullmatch(value):
        raise InvalidRecord(
            field,
            f"must be 1-{MAX_NAME_CHARS} characters of letters, digits, '.', '_' or '-' "
            f"starting with a letter or digit, got {value!r:.80}",
        )


def check_text(field: str, value: str, max_chars: int = MAX_TEXT_CHARS) -> None:
    """Free text: bounded length, printable."""
    if len(value) > max_chars:
        raise InvalidRecord(field, f"is {len(value)} characters; the limit is {max_chars}")
    if not value.isprintable():
        raise InvalidRecord(field, "must contain printable characters only")


def check_choice(field: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise InvalidRecord(field, f"must be one of {', '.join(choices)}; got {value!r:.80}")


def check_int(field: str, value: int, low: int, high: int = 2**63 - 1) -> None:
    if not low <= value <= high:
        raise InvalidRecord(field, f"must be between {low} and {high}, got {value}")


def check_float(field: str, value: float, low: float, high: float = math.inf) -> None:
    """A finite float within [low, high]."""
    if not math.isfinite(value):
        raise InvalidRecord(field, f"must be a finite number, got {value}")
    if not low <= value <= high:
        raise InvalidRecord(field, f"must be between {low} and {high}, got {value}")


def check_public_key(field: str, value: bytes) -> None:
    if len(value) != PUBLIC_KEY_BYTES:
        raise InvalidRecord(field, f"must be a {PUBLIC_KEY_BYTES}-byte Ed25519 public key")


def check_sorted_unique(field: str, values: Sequence[str] | Sequence[bytes]) -> None:
    """Values strictly ascending: canonical order and no repeats."""
    for earlier, later in itertools.pairwise(values):
        if not earlier < later:  # type: ignore[operator]
            raise InvalidRecord(field, "must be sorted ascending without repeats")


def check_count(field: str, values: Sequence[object], low: int, high: int) -> None:
    if not low <= len(values) <= high:
        raise InvalidRecord(field, f"must have between {low} and {high} entries, got {len(values)}")


def check_address(field: str, value: str) -> None:
    """A peer address: an http:// or https:// URL of bounded length."""
    if len(value) > MAX_ADDRESS_CHARS or not value.isprintable() or " " in value:
        raise InvalidRecord(field, f"is not a usable address: {value!r:.80}")
    if not value.startswith(("http://", "https://")):
        raise InvalidRecord(field, f"must start with http:// or https://, got {value!r:.80}")
