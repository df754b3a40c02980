"""The cluster secret, proven in both directions and never sent.

Every exchange on a member's control endpoint starts with this handshake::

    client -> server  Hello      the client's Ed25519 key, a client nonce
    server -> client  Challenge  the server's key, a server nonce
    client -> server  Signed     request body, HMAC(secret, T_client), signature of T_client
    server -> client  Signed     answer body,  HMAC(secret, T_server), signature of T_server
                   or Refused    why (the client's proof did not match)

``T`` (:func:`transcript`) binds a label per direction, the cluster id, both keys, both
nonces and the SHA-256 of the body: a proof answers one challenge only, cannot be reflected
back to the other direction, and vouches for the body it travels with (so who learns a
rendezvous, and from whom, is gated by the secret). The HMAC says "knows the secret"; the
Ed25519 signature says "holds the key its peer id names", so a member cannot speak for
another member's seniority. The client proves first, as in :mod:`p2ptrain.net.auth`: a
stranger without the secret learns nothing but a refusal.

Pure: bytes in, a verdict out (the reason, or None when the proof holds).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Literal

from p2ptrain.core.identity import Identity, verify_signature

__all__ = [
    "NONCE_BYTES",
    "SECRET_DIFFERS",
    "Proof",
    "check_proof",
    "prove",
    "transcript",
]

NONCE_BYTES = 32
_LABELS = {
    "client": b"p2ptrain/v1/cluster/client\x00",
    "server": b"p2ptrain/v1/cluster/server\x00",
}

#: What a member is told when its peer's proof of the secret does not match its own.
SECRET_DIFFERS = (
    "the cluster secret differs: this member and {peer} hold different secret files "
    "(each side's proof of its secret did not match the other's). Copy the secret file of a "
    "member of the cluster to this machine and start again with --secret-file pointing at it"
)


@dataclass(frozen=True, slots=True)
class Proof:
    """Knowledge of the secret (an HMAC) and of the private key (a signature) over one
    transcript."""

    secret_mac: bytes
    signature: bytes


def transcript(
    direction: Literal["client", "server"],
    *,
    cluster_id: str,
    client_key: bytes,
    server_key: bytes,
    client_nonce: bytes,
    server_nonce: bytes,
    body: bytes,
) -> bytes:
    """The bytes a proof covers: each field length-prefixed after the direction's label."""
    fields = (
        cluster_id.encode(),
        client_key,
        server_key,
        client_nonce,
        server_nonce,
        hashlib.sha256(body).digest(),
    )
    return _LABELS[direction] + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _mac(secret: bytes, signed: bytes) -> bytes:
    return hmac.new(secret, signed, hashlib.sha256).digest()


def prove(identity: Identity, secret: bytes, signed: bytes) -> Proof:
    """Our proof over the transcript ``signed``."""
    return Proof(secret_mac=_mac(secret, signed), signature=identity.sign(signed))


def check_proof(
    secret: bytes, public_key: bytes, signed: bytes, proof: Proof, *, peer: str
) -> str | None:
    """Why ``proof`` (by the holder of ``public_key``, called ``peer`` in the reason) does
    not prove the secret and the key over ``signed``; None when it does. A wrong secret is
    reported as :data:`SECRET_DIFFERS`, whatever the signature."""
    if not hmac.compare_digest(proof.secret_mac, _mac(secret, signed)):
        return SECRET_DIFFERS.format(peer=peer)
    if not verify_signature(public_key, signed, proof.signature):
        return f"{peer} signed its proof with another key than the one it named"
    return None
