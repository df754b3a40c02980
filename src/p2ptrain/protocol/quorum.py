"""Quorum rules: votes counted per height, round, stage and head; certificates; polkas;
equivocation evidence.

The quorum is ``manifest.quorum`` distinct validators named in the signed manifest -- never
a number derived from the validators one can see, which would let a partition certify two
heads. q prevotes for one head in one round are a *polka* (validators may commit it); q
commits for one head in one round are a certificate (:mod:`.ballot`). A validator that signs
two heads in one round and stage has *equivocated*: the two signed attestations are evidence
anyone can check, and the book keeps it. What the book keeps of one validator at one height
is bounded: its votes of the last :data:`ROUNDS_KEPT` rounds it reached, and the q prevotes of
each polka.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from p2ptrain.core.certificate import QuorumCertificate, Verdict
from p2ptrain.core.envelope import Signed
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Attestation

__all__ = ["ROUNDS_KEPT", "AttestationBook", "Counted", "Equivocation"]

#: The rounds of one validator's votes kept per height (its latest ones; an older vote is
#: still counted when it arrives, then let go).
ROUNDS_KEPT = 64


@dataclass(frozen=True, slots=True)
class Equivocation:
    """Two attestations by one validator for different heads at one height, in one round
    and stage."""

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
    #: (round, head): this prevote made q prevotes for that head in that round.
    polka: tuple[int, str] | None = None


class AttestationBook:
    """Verified attestations of one experiment, by height, round, stage and validator; it
    forgets heights at or below a certified height once :meth:`forget_through` is called."""

    def __init__(self, manifest: ExperimentManifest, experiment_id: str | None = None) -> None:
        self.manifest = manifest
        self.experiment_id = manifest.id if experiment_id is None else experiment_id
        self._validators = frozenset(manifest.validators)
        #: height -> (round, stage) -> validator -> its attestation
        self._by_height: dict[int, dict[tuple[int, str], dict[bytes, Signed[Attestation]]]] = (
            defaultdict(dict)
        )
        #: height -> validator -> the highest round it voted in
        self._reached: dict[int, dict[bytes, int]] = defaultdict(dict)
        #: height -> round -> the head q validators prevoted there
        self._polkas: dict[int, dict[int, str]] = defaultdict(dict)
        #: height -> round -> the q prevotes of its polka (what a locked validator relays)
        self._polka_votes: dict[int, dict[int, tuple[Signed[Attestation], ...]]] = defaultdict(dict)
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
        ballots = self._by_height[record.height]
        votes = ballots.setdefault((record.round, record.stage), {})
        earlier = votes.get(record.validator)
        if earlier is not None:
            if earlier.record.head_id == record.head_id:
                return Counted(Verdict(True, f"{who} already counted"))
            evidence = Equivocation(record.validator, record.height, earlier, signed)
            self.equivocations.append(evidence)
            return Counted(
                Verdict(
                    False,
                    f"validator {who} equivocated at height {record.height} "
                    f"({record.stage}, round {record.round})",
                ),
                equivocation=evidence,
            )
        votes[record.validator] = signed
        counted = self._count(record, votes)
        # counted first: a late vote of an old round still completes what it completes
        reached = self._reached[record.height]
        latest = max(record.round, reached.get(record.validator, -1))
        reached[record.validator] = latest
        self._forget_rounds(record.height, record.validator, latest - ROUNDS_KEPT)
        return counted

    def _count(self, record: Attestation, votes: dict[bytes, Signed[Attestation]]) -> Counted:
        """What one more vote in its round and stage makes: a polka, a certificate, or a
        count."""
        if record.height in self._certified:
            return Counted(Verdict(True, "counted; the height is already certified"))
        same = [s for s in votes.values() if s.record.head_id == record.head_id]
        quorum = self.manifest.quorum
        if len(same) < quorum:
            return Counted(Verdict(True, f"{len(same)} of {quorum} {record.stage}s for this head"))
        if record.stage == "prevote":
            polkas = self._polkas[record.height]
            if record.round in polkas:
                return Counted(Verdict(True, "counted; the round has its q prevotes"))
            polkas[record.round] = record.head_id
            self._polka_votes[record.height][record.round] = tuple(same)
            return Counted(
                Verdict(True, f"q prevotes in round {record.round}"),
                polka=(record.round, record.head_id),
            )
        certificate = QuorumCertificate.assemble(same)
        self._certified[record.height] = certificate
        return Counted(Verdict(True, "quorum reached"), certificate=certificate)

    def rounds_kept(self, height: int, validator: bytes) -> list[int]:
        """The rounds whose votes of ``validator`` at ``height`` the book keeps."""
        ballots = self._by_height.get(height, {})
        return sorted({r for (r, _), votes in ballots.items() if validator in votes})

    def _forget_rounds(self, height: int, validator: bytes, below: int) -> None:
        """Drop ``validator``'s votes at ``height`` in rounds up to ``below``."""
        ballots = self._by_height[height]
        for key in [k for k in ballots if k[0] <= below]:
            ballots[key].pop(validator, None)
            if not ballots[key]:
                del ballots[key]

    def polka(self, height: int, round_: int) -> str | None:
        """The head q validators prevoted at ``height`` in ``round_`` (None: none yet)."""
        return self._polkas.get(height, {}).get(round_)

    def polka_votes(self, height: int, round_: int) -> tuple[Signed[Attestation], ...]:
        """The q prevotes that made the polka at ``height`` in ``round_`` (empty: none)."""
        return self._polka_votes.get(height, {}).get(round_, ())

    def polkas(self, height: int) -> dict[int, str]:
        """Every round's polka at ``height``: round -> head."""
        return dict(self._polkas.get(height, {}))

    def round_reached(self, height: int, count: int) -> int:
        """The highest round at least ``count`` distinct validators voted in (or after) at
        ``height``; -1 if fewer than ``count`` voted there."""
        rounds = sorted(self._reached.get(height, {}).values(), reverse=True)
        return rounds[count - 1] if 0 < count <= len(rounds) else -1

    def certificate(self, height: int) -> QuorumCertificate | None:
        return self._certified.get(height)

    def forget_through(self, height: int) -> None:
        """Drop the votes of heights up to ``height`` and refuse any later vote there (kept:
        the equivocation evidence)."""
        self._final_through = max(self._final_through, height)
        tables = (self._by_height, self._reached, self._polkas, self._polka_votes, self._certified)
        for table in tables:
            for old in [h for h in table if h <= height]:
                del table[old]
