"""Quorum certificates: exactly the valid ones are accepted."""

from __future__ import annotations

import msgspec
import pytest

from p2ptrain.core.certificate import QuorumCertificate, ValidatorSignature
from p2ptrain.core.encoding import decode, encode
from p2ptrain.core.envelope import seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Attestation
from p2ptrain.errors import InvalidRecord, LocalError, ProtocolViolation
from tests.support.builders import experiment, head, identity

VALIDATORS = [identity(i) for i in range(5)]
MANIFEST = experiment(VALIDATORS, quorum=3)
HEAD = head(MANIFEST.id, height=4, label="a")
OTHER_HEAD = head(MANIFEST.id, height=4, label="b")


def attest(
    validator: Identity,
    head_id: str = HEAD.id,
    manifest: ExperimentManifest = MANIFEST,
    *,
    round_: int = 0,
    stage: str = "commit",
):
    return seal(
        validator,
        Attestation(
            experiment_id=manifest.id,
            height=4,
            head_id=head_id,
            validator=validator.public_key,
            round=round_,
            stage=stage,
        ),
    )


def raw_certificate(entries: list[tuple[Identity, bytes]]) -> QuorumCertificate:
    """A certificate with exactly these signatures (sorted as the encoding requires)."""
    entries = sorted(entries, key=lambda e: e[0].public_key)
    return QuorumCertificate(
        experiment_id=MANIFEST.id,
        height=4,
        head_id=HEAD.id,
        round=0,
        signatures=tuple(
            ValidatorSignature(validator=v.public_key, signature=sig) for v, sig in entries
        ),
    )


def signature(validator: Identity, head_id: str = HEAD.id) -> bytes:
    return attest(validator, head_id).envelope.signature


def test_a_quorum_of_valid_signatures_is_accepted() -> None:
    cert = QuorumCertificate.assemble(attest(v) for v in VALIDATORS[:3])
    verdict = cert.verify(MANIFEST)
    assert verdict.ok, verdict.reason
    assert verdict.reason == "3 of 5 validators signed"
    assert QuorumCertificate.assemble(attest(v) for v in VALIDATORS).verify(MANIFEST)


def test_q_minus_one_signatures_are_rejected() -> None:
    cert = QuorumCertificate.assemble(attest(v) for v in VALIDATORS[:2])
    verdict = cert.verify(MANIFEST)
    assert not verdict
    assert verdict.reason == "2 validator signatures, quorum is 3"


def test_a_repeated_signer_is_rejected() -> None:
    v = VALIDATORS
    cert = raw_certificate(
        [(v[0], signature(v[0])), (v[0], signature(v[0])), (v[1], signature(v[1]))]
    )
    verdict = cert.verify(MANIFEST)
    assert not verdict
    assert "signed twice" in verdict.reason
    # assembling never counts a validator twice
    assembled = QuorumCertificate.assemble([attest(v[0]), attest(v[0]), attest(v[1])])
    assert len(assembled.signatures) == 2
    assert not assembled.verify(MANIFEST)


def test_a_signer_not_in_the_manifest_is_rejected() -> None:
    outsider = identity(99)
    v = VALIDATORS
    cert = raw_certificate(
        [(v[0], signature(v[0])), (v[1], signature(v[1])), (outsider, signature(outsider))]
    )
    verdict = cert.verify(MANIFEST)
    assert not verdict
    assert "not a validator of the experiment" in verdict.reason


def test_a_signature_over_another_head_is_rejected() -> None:
    v = VALIDATORS
    cert = raw_certificate(
        [(v[0], signature(v[0])), (v[1], signature(v[1])), (v[2], signature(v[2], OTHER_HEAD.id))]
    )
    verdict = cert.verify(MANIFEST)
    assert not verdict
    assert "is not over this head" in verdict.reason


def test_a_certificate_for_another_experiment_is_rejected() -> None:
    other = experiment(VALIDATORS, quorum=3, authority=identity(77))
    cert = QuorumCertificate.assemble(attest(v, manifest=other) for v in VALIDATORS[:3])
    assert not cert.verify(MANIFEST)
    assert cert.verify(other)


def test_an_attestation_envelope_signature_is_what_the_certificate_carries() -> None:
    """The certificate's signatures are attestation-envelope signatures, nothing else."""
    cert = QuorumCertificate.assemble(attest(v) for v in VALIDATORS[:3])
    forged = msgspec.structs.replace(
        cert,
        signatures=tuple(
            ValidatorSignature(validator=s.validator, signature=bytes(64)) for s in cert.signatures
        ),
    )
    assert not forged.verify(MANIFEST)


def test_certificates_round_trip_and_decode_strictly() -> None:
    cert = QuorumCertificate.assemble(attest(v) for v in VALIDATORS[:3])
    data = encode(cert)
    assert decode(QuorumCertificate, data, max_bytes=len(data)).verify(MANIFEST)
    unsorted = msgspec.msgpack.encode(
        {
            "experiment_id": cert.experiment_id,
            "height": cert.height,
            "head_id": cert.head_id,
            "round": cert.round,
            "signatures": [
                {"validator": s.validator, "signature": s.signature}
                for s in reversed(cert.signatures)
            ],
        }
    )
    with pytest.raises(ProtocolViolation, match="ordered by validator key"):
        decode(QuorumCertificate, unsorted, max_bytes=4096)


def test_assembling_needs_attestations_of_one_head() -> None:
    with pytest.raises(LocalError):
        QuorumCertificate.assemble([])
    with pytest.raises(LocalError, match="same head"):
        QuorumCertificate.assemble([attest(VALIDATORS[0]), attest(VALIDATORS[1], OTHER_HEAD.id)])


def test_construction_validates_fields() -> None:
    with pytest.raises(InvalidRecord, match="signatures"):
        QuorumCertificate(
            experiment_id=MANIFEST.id, height=4, head_id=HEAD.id, round=0, signatures=()
        )
    with pytest.raises(InvalidRecord, match="head_id"):
        QuorumCertificate(
            experiment_id=MANIFEST.id,
            height=4,
            head_id="not-hex",
            round=0,
            signatures=(ValidatorSignature(validator=bytes(32), signature=bytes(64)),),
        )


def test_a_certificate_is_commits_of_one_round_and_binds_that_round() -> None:
    with pytest.raises(LocalError, match="same head and round"):
        QuorumCertificate.assemble([attest(VALIDATORS[0]), attest(VALIDATORS[1], round_=1)])
    with pytest.raises(LocalError, match="commits, not prevotes"):
        QuorumCertificate.assemble(attest(v, stage="prevote") for v in VALIDATORS[:3])
    certificate = QuorumCertificate.assemble(attest(v, round_=3) for v in VALIDATORS[:3])
    assert certificate.round == 3 and certificate.verify(MANIFEST)
    # the signatures are over round 3: the same certificate naming another round is refused
    moved = msgspec.structs.replace(certificate, round=2)
    verdict = moved.verify(MANIFEST)
    assert not verdict and "is not over this head" in verdict.reason
