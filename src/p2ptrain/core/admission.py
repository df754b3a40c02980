"""Admission certificates to a ``certificate`` network: signing one, and whether one admits
a node (shared by the node, ``p2ptrain admit`` and the issuing service)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from pathlib import Path

from p2ptrain.core.envelope import Signed, open_envelope, seal
from p2ptrain.core.identity import Identity, peer_id_of
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.core.records import AdmissionCertificate
from p2ptrain.errors import LocalError, ProtocolViolation

__all__ = [
    "CERTIFICATE_FILE",
    "certificate_problem",
    "issue_certificate",
    "now_ms",
    "read_certificate",
    "when_text",
]


#: A node's certificate in its data directory.
CERTIFICATE_FILE = "admission.cert"


def now_ms() -> int:
    return int(time.time() * 1000)


def issue_certificate(
    issuer: Identity,
    network_id: str,
    subject: bytes,
    *,
    roles: Sequence[str] = (),
    expires_ms: int = 0,
    name: str = "",
) -> Signed[AdmissionCertificate]:
    """``issuer``'s admission certificate for ``subject`` (signed)."""
    return seal(
        issuer,
        AdmissionCertificate(
            network_id=network_id,
            subject=subject,
            issuer=issuer.public_key,
            not_after_ms=expires_ms,
            roles=tuple(sorted(set(roles))),
            issued_at_ms=now_ms(),
            name=name,
        ),
    )


def read_certificate(path: Path) -> Signed[AdmissionCertificate]:
    """The certificate in ``path`` (its signature verified)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LocalError(f"cannot read the admission certificate {path}: {exc}") from exc
    try:
        return open_envelope(data, AdmissionCertificate)
    except ProtocolViolation as exc:
        raise LocalError(
            f"{path} is not a valid admission certificate ({exc}); ask the network's issuer "
            "for a new one (p2ptrain admit)"
        ) from exc


def when_text(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def certificate_problem(
    certificate: AdmissionCertificate,
    network: NetworkManifest,
    identity: Identity,
    roles: Sequence[str],
    at_ms: int,
) -> str | None:
    """Why ``certificate`` does not admit this node (None: it does)."""
    if certificate.network_id != network.id:
        return f"it is for network {certificate.network_id[:16]}, not {network.id[:16]}"
    if certificate.subject != identity.public_key:
        return (
            f"it names key {certificate.subject.hex()[:16]}..., not this node's "
            f"{identity.public_key.hex()[:16]}... (p2ptrain identity --dir DIR prints it)"
        )
    if certificate.issuer not in network.issuer_keys:
        return f"its issuer {peer_id_of(certificate.issuer)[:16]} is not an issuer of the network"
    if certificate.not_after_ms and certificate.not_after_ms < at_ms:
        return f"it expired at {when_text(certificate.not_after_ms)}"
    if not certificate.allows(tuple(roles)):
        return (
            f"it allows the roles {', '.join(certificate.roles)}, and this node runs "
            f"{', '.join(roles)}"
        )
    return None
