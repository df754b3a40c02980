"""Signed envelopes: the only way a record travels between peers.

An envelope carries a record kind, the record's canonical bytes (the payload), the signer's
Ed25519 public key and a signature over a domain-separated message binding kind and payload.
:func:`open_envelope` checks all of them -- size, encoding, kind, canonical payload, record
validation, that the signer is the record's author, and the signature -- and raises
:class:`~p2ptrain.errors.ProtocolViolation` on anything wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from p2ptrain.core.encoding import decode, encode, sha256_hex
from p2ptrain.core.identity import Identity, peer_id_of, verify_signature
from p2ptrain.core.manifests import ExperimentManifest, NetworkManifest
from p2ptrain.core.records import (
    AdmissionCertificate,
    Attestation,
    MetricsReport,
    PeerRecord,
    Proposal,
    Revocation,
    Update,
)
from p2ptrain.errors import LocalError, ProtocolViolation

R = TypeVar("R")

_DOMAIN = b"p2ptrain/v1/envelope\x00"
#: Envelope overhead beyond the payload: field names, kind, key and signature.
_ENVELOPE_OVERHEAD = 256


@dataclass(frozen=True, slots=True)
class RecordKind:
    """How one kind of record travels: its name, type, size ceiling and author key."""

    name: str
    type: type[Any]
    max_payload_bytes: int
    author: Callable[[Any], bytes]


KINDS: dict[str, RecordKind] = {
    kind.name: kind
    for kind in (
        RecordKind("network", NetworkManifest, 64 << 10, lambda r: r.authority),
        RecordKind("experiment", ExperimentManifest, 16 << 20, lambda r: r.authority),
        RecordKind("peer", PeerRecord, 16 << 10, lambda r: r.public_key),
        RecordKind("update", Update, 256 << 10, lambda r: r.trainer),
        RecordKind("proposal", Proposal, 64 << 20, lambda r: r.reducer),
        RecordKind("attestation", Attestation, 4 << 10, lambda r: r.validator),
        RecordKind("admission", AdmissionCertificate, 1 << 10, lambda r: r.issuer),
        RecordKind("revocation", Revocation, 1 << 10, lambda r: r.issuer),
        RecordKind("metrics", MetricsReport, 1 << 10, lambda r: r.evaluator),
    )
}
_KIND_OF_TYPE: dict[type[Any], RecordKind] = {kind.type: kind for kind in KINDS.values()}

MAX_ENVELOPE_BYTES = max(k.max_payload_bytes for k in KINDS.values()) + _ENVELOPE_OVERHEAD


class Envelope(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A record's canonical bytes with the author's signature."""

    kind: str
    payload: bytes
    signer: bytes
    signature: bytes

    def encode(self) -> bytes:
        return encode(self)


@dataclass(frozen=True, slots=True)
class Signed(Generic[R]):
    """A record whose envelope has been fully verified."""

    record: R
    envelope: Envelope

    @property
    def record_id(self) -> str:
        """The record's id: SHA-256 of its canonical bytes (the payload)."""
        return sha256_hex(self.envelope.payload)

    @property
    def signer_id(self) -> str:
        return peer_id_of(self.envelope.signer)


def signing_message(kind: str, payload: bytes) -> bytes:
    """The bytes an author signs: a domain tag, the kind and the payload."""
    return _DOMAIN + kind.encode() + b"\x00" + payload


def kind_of(record_type: type[Any]) -> RecordKind:
    try:
        return _KIND_OF_TYPE[record_type]
    except KeyError:
        raise LocalError(f"{record_type.__name__} records are not sent in envelopes") from None


def seal(identity: Identity, record: R) -> Signed[R]:
    """Sign ``record`` as its author. Raises LocalError if ``identity`` is not the author."""
    kind = kind_of(type(record))
    if kind.author(record) != identity.public_key:
        raise LocalError(
            f"this node's key is not the author named in the {kind.name} record; "
            "sign it with the key the record names"
        )
    payload = encode(record)
    if len(payload) > kind.max_payload_bytes:
        raise LocalError(
            f"{kind.name} record is {len(payload)} bytes; the limit is {kind.max_payload_bytes}"
        )
    signature = identity.sign(signing_message(kind.name, payload))
    envelope = Envelope(
        kind=kind.name, payload=payload, signer=identity.public_key, signature=signature
    )
    return Signed(record, envelope)


def open_envelope(
    data: bytes | bytearray | memoryview,
    expected: type[R],
    *,
    max_bytes: int = MAX_ENVELOPE_BYTES,
) -> Signed[R]:
    """Decode and verify an envelope carrying a record of type ``expected``.

    Raises ProtocolViolation for anything wrong: size, encoding, kind, payload, author or
    signature. Returns the verified record.
    """
    kind = kind_of(expected)
    limit = min(max_bytes, kind.max_payload_bytes + _ENVELOPE_OVERHEAD)
    envelope = decode(Envelope, data, max_bytes=limit)
    return verify_envelope(envelope, expected)


def verify_envelope(envelope: Envelope, expected: type[R]) -> Signed[R]:
    """Verify an already decoded envelope; see :func:`open_envelope`."""
    kind = kind_of(expected)
    if envelope.kind != kind.name:
        raise ProtocolViolation(f"expected a {kind.name!r} envelope, got {envelope.kind!r:.40}")
    record: R = decode(expected, envelope.payload, max_bytes=kind.max_payload_bytes)
    if kind.author(record) != envelope.signer:
        raise ProtocolViolation(f"{kind.name} envelope is signed by someone other than its author")
    if not verify_signature(
        envelope.signer, signing_message(kind.name, envelope.payload), envelope.signature
    ):
        raise ProtocolViolation(f"{kind.name} envelope has an invalid signature")
    return Signed(record, envelope)
