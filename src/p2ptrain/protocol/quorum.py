"""Quorum rules: attestations counted per head, certificates, and equivocation evidence.

The quorum is ``manifest.quorum`` distinct validators named in the signed manifest -- never
a number derived from the validators one can see, which would let a partition certify two
heads. A validator that signs two heads at one height has *equivocated*: the two signed
attestations are evidence anyone can check, and the book keeps it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from p2ptrain.core.certificate import QuorumCertificate, Verdict
from p2ptrain.core.envelope import Signed
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Attestation

__all__ = ["AttestationBook", "Counted", "Equivocation"]


@dataclass(frozen=True, slots=True)
class Equivocation:
    """Two attestations by one validator for different heads at one height."""

    validator: bytes
    height: int
    first: Signed[Attestation]
    second: Signed[Attestation]

    @property
    def validator_id(self) -> str:
        return peer_id_of(self.validator)


@dataclass(frozen=True, slots=True)
class Counted:
    """What adding one attestation did."""

    verdict: Verdict
    certificate: QuorumCertificate | None = None
    equivocation: Equivocation | None = None


class AttestationBook:
    """Verified attestations of one experiment, by height and head; it forgets heights at
    or below a certified height once :meth:`forget_through` is called."""

    def __init__(self, manifest: ExperimentManifest, experiment_id: str | None = None) -> None:
        self.manifest = manifest
        self.experiment_id = manifest.id if experiment_id is None else experiment_id
        self._validators = frozenset(manifest.validators)
        self._by_height: dict[int, dict[bytes, Signed[Attestation]]] = defaultdict(dict)
        self._certified: dict[int, QuorumCertificate] = {}
        self.equivocations: list[Equivocation] = []
        self._final_through = -1

    def add(self, signed: Signed[Attestation]) -> Counted:
        """Count an attestation whose envelope signature was verified by ``open_envelope``."""
        record = signed.record
        who = peer_id_of(record.validator)[:12]
        if record.experiment_id != self.experiment_id:
            return Counted(Verdict(False, "attestation is for another experiment"))
        if record.validator not in self._validators:
            return Counted(Verdict(False, f"{who} is not a validator of the experiment"))
        if record.height <= self._final_through:
            return Counted(Verdict(False, f"height {record.height} is already final here"))
        votes = self._by_height[record.height]
        earlier = votes.get(record.validator)
        if earlier is not None:
            if earlier.record.head_id == record.head_id:
                return Counted(Verdict(True, f"{who} already counted"))
            evidence = Equivocation(record.validator, record.height, earlier, signed)
            self.equivocations.append(evidence)
            return Counted(
                Verdict(False, f"validator {who} equivocated at height {record.height}"),
                equivocation=evidence,
            )
        votes[record.validator] = signed
        if record.height in self._certified:
            return Counted(Verdict(True, "counted; the height is already certified"))
        same = [s for s in votes.values() if s.record.head_id == record.head_id]
        if len(same) < self.manifest.quorum:
            return Counted(
                Verdict(True, f"{len(same)} of {self.manifest.quorum} attestations for this head")
            )
        certificate = QuorumCertificate.assemble(same)
        self._certified[record.height] = certificate
        return Counted(Verdict(True, "quorum reached"), certificate=certificate)

    def certificate(self, height: int) -> QuorumCertificate | None:
        return self._certified.get(height)

    def forget_through(self, height: int) -> None:
        """Drop the votes of heights up to ``height`` and refuse any later vote there (kept:
        the equivocation evidence)."""
        self._final_through = max(self._final_through, height)
        for old in [h for h in self._by_height if h <= height]:
            del self._by_height[old]
        for old in [h for h in self._certified if h <= height]:
            del self._certified[old]
