"""Ed25519 identities and peer ids.

A peer id is the lowercase hex SHA-256 of the raw 32-byte Ed25519 public key, so anyone
holding a public key can derive the id, and an id names exactly one key. This module does no
I/O; :mod:`p2ptrain.store.keyfile` persists identities.
"""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from p2ptrain.errors import LocalError

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def peer_id_of(public_key: bytes) -> str:
    """The peer id for a raw Ed25519 public key."""
    return hashlib.sha256(public_key).hexdigest()


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True when ``signature`` is a valid Ed25519 signature of ``message`` by ``public_key``.

    Never raises: malformed keys or signatures simply do not verify.
    """
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """An Ed25519 key pair: signs messages and names a peer."""

    __slots__ = ("_private", "peer_id", "public_key")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: str = peer_id_of(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity whose 32-byte private seed is ``seed`` (deterministic; for tests)."""
        if len(seed) != 32:
            raise LocalError(f"an Ed25519 seed is 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def from_pem(cls, pem: bytes) -> Identity:
        """Load a PKCS#8 PEM private key, as written by :meth:`to_pem`."""
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise LocalError(
                f"the identity key is not a valid PEM private key ({exc}); "
                "restore it from a backup or create a new data directory with `p2ptrain init`"
            ) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise LocalError("the identity key is not an Ed25519 key; p2ptrain uses Ed25519 only")
        return cls(key)

    def to_pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM (keep it mode 0600)."""
        return self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def sign(self, message: bytes) -> bytes:
        """Ed25519 signature of ``message``."""
        return self._private.sign(message)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id[:16]}...)"
