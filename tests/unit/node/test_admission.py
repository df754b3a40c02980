"""A node's own certificate, checked before it starts, and the issuer's command-line
parsing (``p2ptrain admit``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2ptrain.cli.admission_commands import parse_expiry, parse_key, parse_roles
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.errors import LocalError
from p2ptrain.node.admission import (
    CERTIFICATE_FILE,
    certificate_problem,
    issue_certificate,
    node_certificate,
)
from tests.support.builders import identity

ISSUER, PEER, OTHER = identity(1), identity(2), identity(3)
NETWORK = NetworkManifest(
    name="certified",
    authority=ISSUER.public_key,
    admission="certificate",
    issuer_keys=(ISSUER.public_key,),
)
NOW = 1_800_000_000_000


@pytest.mark.parametrize(
    ("issuer", "subject", "roles", "expires", "says"),
    [
        (ISSUER, PEER, (), 0, None),
        (ISSUER, PEER, ("trainer",), NOW + 1, None),
        (OTHER, PEER, (), 0, "not an issuer"),
        (ISSUER, OTHER, (), 0, "not this node's"),
        (ISSUER, PEER, (), NOW - 1, "expired at"),
        (ISSUER, PEER, ("validator",), 0, "allows the roles validator"),
    ],
)
def test_a_certificate_admits_its_key_with_its_roles_until_it_expires(
    issuer: object, subject: object, roles: tuple[str, ...], expires: int, says: str | None
) -> None:
    signed = issue_certificate(
        issuer,  # type: ignore[arg-type]
        NETWORK.id,
        subject.public_key,  # type: ignore[attr-defined]
        roles=roles,
        expires_ms=expires,
    )
    problem = certificate_problem(signed.record, NETWORK, PEER, ("trainer",), NOW)
    assert problem is None if says is None else says in (problem or "")


def test_a_node_keeps_the_certificate_it_was_given_and_an_issuer_certifies_itself(
    tmp_path: Path,
) -> None:
    given = tmp_path / "peer.cert"
    given.write_bytes(issue_certificate(ISSUER, NETWORK.id, PEER.public_key).envelope.encode())
    peer_dir = tmp_path / "peer"
    peer_dir.mkdir()
    first = node_certificate(NETWORK, PEER, peer_dir, ("trainer",), given)
    again = node_certificate(NETWORK, PEER, peer_dir, ("trainer",), None)  # a restart
    assert first is not None and again is not None and again.record == first.record
    assert (peer_dir / CERTIFICATE_FILE).exists()
    issuer_dir = tmp_path / "issuer"
    issuer_dir.mkdir()
    own = node_certificate(NETWORK, ISSUER, issuer_dir, ("seed",), None)
    assert own is not None and own.record.subject == ISSUER.public_key
    with pytest.raises(LocalError, match="send this node's public key"):
        node_certificate(NETWORK, OTHER, tmp_path / "other", ("trainer",), None)


def test_the_admit_options_are_read_or_refused_with_the_form_to_use() -> None:
    assert parse_key(PEER.public_key.hex()) == PEER.public_key
    with pytest.raises(LocalError, match="64 hex"):
        parse_key("abc")
    assert parse_roles("validator, trainer") == ("trainer", "validator")
    with pytest.raises(LocalError, match="choose from"):
        parse_roles("trainer,pilot")
    assert parse_expiry("never", NOW) == 0
    assert parse_expiry("90d", NOW) == NOW + 90 * 86_400_000
    assert parse_expiry("1.5h", NOW) == NOW + 5_400_000
    with pytest.raises(LocalError, match="90d, 12h"):
        parse_expiry("soon", NOW)
