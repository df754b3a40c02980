"""A node's admission to a ``certificate`` network, and the revocations it keeps.

A certificate network names its issuers in its manifest (the seed's key by default). Each
node shows an :class:`~p2ptrain.core.records.AdmissionCertificate` for its own key on
every request: the one given with ``--certificate FILE`` (``p2ptrain admit`` writes it),
kept in the data directory so a restart needs no flag; an issuer's own node certifies
itself. A certificate is checked before the node starts (the network, the key, the issuer,
the expiry and the roles), so a wrong one fails with its reason at once instead of as a
refusal at every peer's door.

Revocations (``p2ptrain revoke``) are kept in the node's store: a restarted node cuts the
revoked peers off before it opens a connection, and passes the revocations to every peer
it connects to.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from p2ptrain.core.admission import (
    CERTIFICATE_FILE,
    certificate_problem,
    issue_certificate,
    now_ms,
    read_certificate,
)
from p2ptrain.core.envelope import Signed, open_envelope
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.core.records import AdmissionCertificate, Revocation
from p2ptrain.errors import LocalError
from p2ptrain.node.persist import NodeStore
from p2ptrain.store.atomic import write_atomically

__all__ = [
    "CERTIFICATE_FILE",
    "REVOCATION_KIND",
    "certificate_problem",
    "issue_certificate",
    "keep_revocation",
    "kept_revocations",
    "node_certificate",
    "now_ms",
    "read_certificate",
]

REVOCATION_KIND = "revocation"


def node_certificate(
    network: NetworkManifest,
    identity: Identity,
    data_dir: Path,
    roles: Sequence[str],
    given: Path | None,
) -> Signed[AdmissionCertificate] | None:
    """The certificate this node shows (None on a network that admits without one): the
    one ``given`` (kept in ``data_dir`` from now on), else the one kept there, else one it
    issues itself when its key is an issuer's."""
    if network.admission != "certificate":
        return None
    kept = data_dir / CERTIFICATE_FILE
    path = given or (kept if kept.exists() else None)
    if path is None:
        if identity.public_key in network.issuer_keys:  # an issuer admits itself
            signed = issue_certificate(identity, network.id, identity.public_key)
            write_atomically(kept, signed.envelope.encode())
            return signed
        raise LocalError(
            f"network {network.name!r} admits only peers with a certificate: send this node's "
            f"public key ({identity.public_key.hex()}) to the network's issuer, who runs "
            "p2ptrain admit KEY, and start the node with --certificate FILE"
        )
    signed = read_certificate(path)
    problem = certificate_problem(signed.record, network, identity, roles, now_ms())
    if problem is not None:
        raise LocalError(
            f"the admission certificate {path} does not admit this node: {problem}; ask the "
            "network's issuer for a new one (p2ptrain admit)"
        )
    if given is not None:
        write_atomically(kept, signed.envelope.encode())
    return signed


def kept_revocations(store: NodeStore, network: NetworkManifest) -> list[Signed[Revocation]]:
    """The revocations of ``network`` this node kept."""
    kept = []
    for _, data in store.state.records(REVOCATION_KIND):
        signed = open_envelope(data, Revocation)
        if signed.record.network_id == network.id:
            kept.append(signed)
    return kept


def keep_revocation(store: NodeStore, signed: Signed[Revocation]) -> None:
    store.state.put_record(
        signed.record_id, REVOCATION_KIND, bytes(signed.envelope.encode()), signer=signed.signer_id
    )
