"""The attestation book: distinct manifest validators, q of them in one round and stage,
polkas, the rounds validators reached, and equivocation evidence."""

from __future__ import annotations

from p2ptrain.core.envelope import Signed, seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.records import Attestation, Head
from p2ptrain.protocol.quorum import ROUNDS_KEPT, AttestationBook
from tests.support.builders import experiment, h, head, identity

VALIDATORS = [identity(i) for i in range(5)]
MANIFEST = experiment(VALIDATORS, quorum=3)
HEAD = head(MANIFEST.id, height=4, label="a")
OTHER = head(MANIFEST.id, height=4, label="b")
NEXT = head(MANIFEST.id, height=5, label="c")


def attest(
    validator: Identity,
    target: Head = HEAD,
    experiment_id: str = MANIFEST.id,
    *,
    round_: int = 0,
    stage: str = "commit",
) -> Signed[Attestation]:
    return seal(
        validator,
        Attestation(
            experiment_id=experiment_id,
            height=target.height,
            head_id=target.id,
            validator=validator.public_key,
            round=round_,
            stage=stage,
        ),
    )


def test_q_minus_one_attestations_make_no_certificate() -> None:
    book = AttestationBook(MANIFEST)
    for n, validator in enumerate(VALIDATORS[:2], start=1):
        counted = book.add(attest(validator))
        assert counted.verdict.ok
        assert counted.verdict.reason == f"{n} of 3 commits for this head"
        assert counted.certificate is None
        assert counted.equivocation is None
    assert book.certificate(4) is None


def test_q_distinct_attestations_make_a_certificate_that_verifies() -> None:
    book = AttestationBook(MANIFEST)
    book.add(attest(VALIDATORS[3]))
    book.add(attest(VALIDATORS[0]))
    counted = book.add(attest(VALIDATORS[4]))
    assert counted.verdict.reason == "quorum reached"
    certificate = counted.certificate
    assert certificate is not None
    assert book.certificate(4) == certificate
    assert certificate.head_id == HEAD.id
    assert certificate.height == 4
    assert certificate.experiment_id == MANIFEST.id
    assert {s.validator for s in certificate.signatures} == {
        VALIDATORS[i].public_key for i in (0, 3, 4)
    }
    verdict = certificate.verify(MANIFEST)
    assert verdict.ok, verdict.reason


def test_votes_for_another_head_do_not_count_towards_this_one() -> None:
    book = AttestationBook(MANIFEST)
    book.add(attest(VALIDATORS[0], OTHER))
    book.add(attest(VALIDATORS[1], OTHER))
    assert book.add(attest(VALIDATORS[2])).certificate is None
    assert book.add(attest(VALIDATORS[3])).certificate is None
    counted = book.add(attest(VALIDATORS[4]))
    assert counted.certificate is not None
    assert counted.certificate.head_id == HEAD.id
    assert counted.certificate.verify(MANIFEST)


def test_a_repeated_attestation_is_not_double_counted() -> None:
    book = AttestationBook(MANIFEST)
    first = attest(VALIDATORS[0])
    assert book.add(first).verdict.reason == "1 of 3 commits for this head"
    for _ in range(3):
        again = book.add(first)
        assert again.verdict.ok
        assert again.verdict.reason.endswith("already counted")
        assert again.certificate is None
    assert book.add(attest(VALIDATORS[1])).verdict.reason == "2 of 3 commits for this head"
    assert book.certificate(4) is None
    assert book.add(attest(VALIDATORS[2])).certificate is not None
    assert book.equivocations == []


def test_a_non_validator_is_refused() -> None:
    book = AttestationBook(MANIFEST)
    outsiders = [identity(100 + i) for i in range(5)]
    for outsider in outsiders:
        counted = book.add(attest(outsider))
        assert not counted.verdict
        assert "is not a validator of the experiment" in counted.verdict.reason
        assert counted.verdict.reason.startswith(outsider.peer_id[:12])
    book.add(attest(VALIDATORS[0]))
    assert book.add(attest(VALIDATORS[1])).certificate is None


def test_an_attestation_for_another_experiment_is_refused() -> None:
    book = AttestationBook(MANIFEST)
    other = experiment(VALIDATORS, quorum=1, authority=identity(1001))
    counted = book.add(attest(VALIDATORS[0], HEAD, experiment_id=other.id))
    assert not counted.verdict
    assert counted.verdict.reason == "attestation is for another experiment"
    book.add(attest(VALIDATORS[1]))
    assert book.add(attest(VALIDATORS[2])).verdict.reason == "2 of 3 commits for this head"


def test_two_heads_at_one_height_from_one_validator_are_an_equivocation() -> None:
    book = AttestationBook(MANIFEST)
    liar = VALIDATORS[2]
    first, second = attest(liar, HEAD), attest(liar, OTHER)
    assert book.add(first).verdict.ok
    counted = book.add(second)
    assert not counted.verdict
    assert counted.verdict.reason == (
        f"validator {liar.peer_id[:12]} equivocated at height 4 (commit, round 0)"
    )
    evidence = counted.equivocation
    assert evidence is not None
    assert evidence.validator == liar.public_key
    assert evidence.validator_id == liar.peer_id
    assert evidence.height == 4
    assert evidence.first == first
    assert evidence.second == second
    assert book.equivocations == [evidence]
    # The second vote is not counted: OTHER needs three more validators.
    book.add(attest(VALIDATORS[0], OTHER))
    assert book.add(attest(VALIDATORS[1], OTHER)).certificate is None
    assert book.add(attest(VALIDATORS[3], OTHER)).certificate is not None


def test_votes_at_different_heights_are_not_an_equivocation() -> None:
    book = AttestationBook(MANIFEST)
    validator = VALIDATORS[0]
    assert book.add(attest(validator, HEAD)).verdict.ok
    assert book.add(attest(validator, NEXT)).verdict.ok
    assert book.equivocations == []


def test_late_votes_for_a_certified_height_are_counted_but_certify_nothing_new() -> None:
    book = AttestationBook(MANIFEST)
    for validator in VALIDATORS[:3]:
        certificate = book.add(attest(validator)).certificate
    assert certificate is not None
    late = book.add(attest(VALIDATORS[3]))
    assert late.verdict.ok
    assert late.certificate is None
    assert book.certificate(4) == certificate


def test_forget_through_drops_votes_and_certificates_up_to_a_height() -> None:
    book = AttestationBook(MANIFEST)
    for validator in VALIDATORS[:3]:
        book.add(attest(validator, HEAD))
    book.add(attest(VALIDATORS[4], HEAD))
    book.add(attest(VALIDATORS[4], OTHER))  # equivocation evidence, kept
    for validator in VALIDATORS[:2]:
        book.add(attest(validator, NEXT))
    assert book.certificate(4) is not None
    book.forget_through(4)
    assert book.certificate(4) is None
    assert len(book.equivocations) == 1
    # Height 5 is remembered: one more vote certifies it.
    assert book.add(attest(VALIDATORS[2], NEXT)).certificate is not None
    assert book.certificate(5) is not None
    # Height 4 is final: a late vote there is refused, not counted from one again.
    late = book.add(attest(VALIDATORS[0], HEAD))
    assert not late.verdict.ok
    assert late.verdict.reason == "height 4 is already final here"
    assert late.certificate is None


def test_the_book_names_its_experiment() -> None:
    assert AttestationBook(MANIFEST).experiment_id == MANIFEST.id
    assert AttestationBook(MANIFEST, experiment_id=h("x")).experiment_id == h("x")


def test_q_prevotes_make_a_polka_once_and_no_certificate() -> None:
    book = AttestationBook(MANIFEST)
    for validator in VALIDATORS[:2]:
        assert book.add(attest(validator, stage="prevote", round_=2)).polka is None
    counted = book.add(attest(VALIDATORS[2], stage="prevote", round_=2))
    assert counted.polka == (2, HEAD.id) and counted.certificate is None
    assert book.add(attest(VALIDATORS[3], stage="prevote", round_=2)).polka is None  # once
    assert book.polka(4, 2) == HEAD.id and book.polka(4, 1) is None
    assert book.polkas(4) == {2: HEAD.id}
    assert book.certificate(4) is None


def test_commits_of_different_rounds_do_not_make_a_certificate() -> None:
    book = AttestationBook(MANIFEST)
    book.add(attest(VALIDATORS[0], round_=0))
    book.add(attest(VALIDATORS[1], round_=1))
    assert book.add(attest(VALIDATORS[2], round_=2)).certificate is None
    book.add(attest(VALIDATORS[3], round_=2))
    certificate = book.add(attest(VALIDATORS[4], round_=2)).certificate
    assert certificate is not None and certificate.round == 2
    assert {s.validator for s in certificate.signatures} == {
        VALIDATORS[i].public_key for i in (2, 3, 4)
    }
    assert certificate.verify(MANIFEST)


def test_another_head_in_another_round_or_stage_is_no_equivocation() -> None:
    book = AttestationBook(MANIFEST)
    validator = VALIDATORS[0]
    assert book.add(attest(validator, HEAD, stage="prevote", round_=0)).verdict.ok
    assert book.add(attest(validator, OTHER, stage="prevote", round_=1)).verdict.ok
    assert book.add(attest(validator, OTHER, stage="commit", round_=1)).verdict.ok
    assert book.equivocations == []
    counted = book.add(attest(validator, HEAD, stage="prevote", round_=1))
    assert counted.equivocation is not None
    assert counted.verdict.reason.endswith("(prevote, round 1)")


def test_round_reached_counts_distinct_validators_at_or_after_a_round() -> None:
    book = AttestationBook(MANIFEST)
    assert book.round_reached(4, 1) == -1
    book.add(attest(VALIDATORS[0], stage="prevote", round_=7))
    book.add(attest(VALIDATORS[1], stage="prevote", round_=3))
    book.add(attest(VALIDATORS[1], stage="prevote", round_=1))  # an older vote arriving late
    assert book.round_reached(4, 1) == 7
    assert book.round_reached(4, 2) == 3
    assert book.round_reached(4, 3) == -1


def test_what_the_book_keeps_of_one_validator_is_its_latest_rounds() -> None:
    book = AttestationBook(MANIFEST)
    flooder = VALIDATORS[0]
    for round_ in range(200):
        book.add(attest(flooder, stage="prevote", round_=round_))
    assert book.rounds_kept(4, flooder.public_key) == list(range(200 - ROUNDS_KEPT, 200))
    # a late vote of an old round still completes the polka it belongs to, then is let go
    book.add(attest(VALIDATORS[1], stage="prevote", round_=3))
    counted = book.add(attest(VALIDATORS[2], stage="prevote", round_=3))
    assert counted.polka is None  # the flooder's round-3 prevote is gone
    late = book.add(attest(flooder, stage="prevote", round_=3))
    assert late.verdict.ok and late.polka == (3, HEAD.id)
    assert len(book.polka_votes(4, 3)) == 3
    assert 3 not in book.rounds_kept(4, flooder.public_key)
