"""A node's requests to the issuing service, signed with its key: the issuer certifies only
a key whose holder proved it holds it.

The body is JSON with the node's public key (``key``, hex) and the time (``at_ms``); the
``X-P2ptrain-Signature`` header is the key's Ed25519 signature (hex) over
``CONTEXT || path || "\\n" || body``, so a signature for one endpoint is not one for another.
The issuer accepts a request whose time is within :data:`MAX_SKEW_MS` of its own clock.
"""

from __future__ import annotations

import json
from typing import Any, Final

from p2ptrain.core.admission import now_ms
from p2ptrain.core.identity import Identity, verify_signature

__all__ = ["CONTEXT", "MAX_BODY_BYTES", "MAX_SKEW_MS", "SIGNATURE_HEADER", "open_request", "sign"]

SIGNATURE_HEADER: Final = "X-P2ptrain-Signature"
CONTEXT: Final = b"p2ptrain issuer request v1\n"
MAX_SKEW_MS: Final = 300_000
#: The most a signed request's body may hold (a certificate and a few fields).
MAX_BODY_BYTES: Final = 16 * 1024


def sign(identity: Identity, path: str, fields: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a request to ``path`` signed by ``identity``."""
    body = json.dumps(
        {**fields, "key": identity.public_key.hex(), "at_ms": now_ms()}, sort_keys=True
    ).encode()
    signature = identity.sign(CONTEXT + path.encode() + b"\n" + body)
    return body, {SIGNATURE_HEADER: signature.hex(), "Content-Type": "application/json"}


def open_request(path: str, body: bytes, signature_hex: str) -> tuple[bytes, dict[str, Any]]:
    """The signer's public key and the fields of a signed request to ``path``; raises
    ValueError saying what is wrong with it."""
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"the request body is over {MAX_BODY_BYTES} bytes")
    try:
        fields = json.loads(body)
        key = bytes.fromhex(str(fields["key"]))
        at_ms = int(fields["at_ms"])
        signature = bytes.fromhex(signature_hex)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a signed issuer request ({exc})") from exc
    if not isinstance(fields, dict) or len(key) != 32:
        raise ValueError("not a signed issuer request (key)")
    if not verify_signature(key, CONTEXT + path.encode() + b"\n" + body, signature):
        raise ValueError(f"the signature in {SIGNATURE_HEADER} is not the key's")
    if abs(now_ms() - at_ms) > MAX_SKEW_MS:
        raise ValueError(
            "the request's time is more than 5 minutes from the issuer's clock: set this "
            "machine's clock (NTP)"
        )
    return key, fields
