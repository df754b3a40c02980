"""Quorum certificates: >= q commits from distinct manifest validators over one head, all
in one voting round.

A certificate holds the validators' raw signatures over the commit attestations they signed,
so anyone with the experiment manifest can check it without trusting whoever relayed it.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from p2ptrain.core import field_rules as rules
from p2ptrain.core.encoding import encode, record_id
from p2ptrain.core.envelope import Signed, signing_message
from p2ptrain.core.identity import peer_id_of, verify_signature
from p2ptrain.core.manifests import MAX_VALIDATORS, ExperimentManifest
from p2ptrain.core.records import MAX_ROUND, Attestation, Head
from p2ptrain.errors import InvalidRecord, LocalError


class Verdict(msgspec.Struct, frozen=True):
    """The outcome of a check, with the reason either way."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


class ValidatorSignature(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    validator: bytes
    signature: bytes


class QuorumCertificate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Signatures of validators over the commit (experiment, height, head id, round)."""

    experiment_id: str
    height: int
    head_id: str
    round: int
    signatures: tuple[ValidatorSignature, ...]

    def __post_init__(self) -> None:
        rules.check_hex_id("experiment_id", self.experiment_id)
        rules.check_int("height", self.height, 1)
        rules.check_int("round", self.round, 0, MAX_ROUND)
        rules.check_hex_id("head_id", self.head_id)
        rules.check_count("signatures", self.signatures, 1, MAX_VALIDATORS)
        keys = [s.validator for s in self.signatures]
        if keys != sorted(keys):
            raise InvalidRecord("signatures", "must be ordered by validator key")

    @property
    def id(self) -> str:
        return record_id(self)

    def attestation_for(self, validator: bytes) -> Attestation:
        """The commit a validator signs to be counted in this certificate."""
        return Attestation(
            experiment_id=self.experiment_id,
            height=self.height,
            head_id=self.head_id,
            validator=validator,
            round=self.round,
            stage="commit",
        )

    def verify(self, manifest: ExperimentManifest) -> Verdict:
        """Accept only >= q valid signatures by distinct validators of ``manifest``.

        Every signature must be valid over this certificate's head id; one bad entry
        rejects the whole certificate (an honest assembler never includes one).
        """
        if self.experiment_id != manifest.id:
            return Verdict(False, "certificate is for another experiment")
        allowed = set(manifest.validators)
        seen: set[bytes] = set()
        for entry in self.signatures:
            who = peer_id_of(entry.validator)[:16]
            if entry.validator in seen:
                return Verdict(False, f"validator {who} signed twice")
            seen.add(entry.validator)
            if entry.validator not in allowed:
                return Verdict(False, f"signer {who} is not a validator of the experiment")
            message = signing_message("attestation", encode(self.attestation_for(entry.validator)))
            if not verify_signature(entry.validator, message, entry.signature):
                return Verdict(False, f"signature of validator {who} is not over this head")
        if len(seen) < manifest.quorum:
            return Verdict(False, f"{len(seen)} validator signatures, quorum is {manifest.quorum}")
        return Verdict(True, f"{len(seen)} of {len(manifest.validators)} validators signed")

    @classmethod
    def assemble(cls, attestations: Iterable[Signed[Attestation]]) -> QuorumCertificate:
        """Build a certificate from verified commits of one head in one round (one per
        validator)."""
        by_validator: dict[bytes, Signed[Attestation]] = {}
        for signed in attestations:
            by_validator.setdefault(signed.record.validator, signed)
        if not by_validator:
            raise LocalError("cannot assemble a quorum certificate from no attestations")
        targets = {
            (s.record.experiment_id, s.record.height, s.record.head_id, s.record.round)
            for s in by_validator.values()
        }
        if len(targets) != 1:
            raise LocalError("attestations to assemble must all be for the same head and round")
        if any(s.record.stage != "commit" for s in by_validator.values()):
            raise LocalError("a certificate is assembled from commits, not prevotes")
        experiment_id, height, head_id, round_ = targets.pop()
        signatures = tuple(
            ValidatorSignature(validator=key, signature=by_validator[key].envelope.signature)
            for key in sorted(by_validator)
        )
        return cls(
            experiment_id=experiment_id,
            height=height,
            head_id=head_id,
            round=round_,
            signatures=signatures,
        )


class CertifiedLink(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A head with the certificate that makes it canonical: what gossip carries when a head
    is certified, and what a node stores per height. Only the certificate is trusted, and
    only after :meth:`QuorumCertificate.verify` and a check that it names this head."""

    head: Head
    certificate: QuorumCertificate

    def check(self, manifest: ExperimentManifest, experiment_id: str) -> Verdict:
        """Whether the certificate is valid and certifies exactly this head."""
        if self.head.experiment_id != experiment_id:
            return Verdict(False, "head is for another experiment")
        if self.certificate.head_id != self.head.id or self.certificate.height != self.head.height:
            return Verdict(False, "certificate does not name this head")
        return self.certificate.verify(manifest)
