"""The participant (protocol/participant.py) driven by hand: two validators (q = 2) that
also propose take one window from updates to a certified head; each counts its own vote
once, a proposal whose head is not the one the updates make is not attested, and a proposal
for another window is not taken. (The early close on expected trainers:
test_expected_trainers.py.)"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from p2ptrain.aggregate.codecs import make_encoder
from p2ptrain.core.envelope import Signed, seal
from p2ptrain.core.records import Proposal, Update
from p2ptrain.core.tensors import schema_of
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.follower import Follower
from p2ptrain.protocol.participant import Participant, ReductionTiming
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.workloads import SyntheticWorkload
from tests.support.builders import h, identity, synthetic_experiment

WORKLOAD = SyntheticWorkload(seed=5)
A, B = identity(1), identity(2)
MANIFEST = msgspec.structs.replace(
    synthetic_experiment(WORKLOAD, A.public_key, max_updates=2),
    validators=tuple(sorted((A.public_key, B.public_key))),
    quorum=2,
)
GENESIS = WORKLOAD.genesis()
TRAINERS = [identity(30 + n) for n in range(2)]


def _update(n: int) -> tuple[Signed[Update], bytes]:
    machine = TrainerMachine(MANIFEST, TRAINERS[n], GENESIS)
    (train,) = machine.start(0.0)
    assert isinstance(train, act.Train)
    delta, before, after = WORKLOAD.train(GENESIS, machine.lease(1), n, 1)
    blob = bytes(make_encoder(MANIFEST.codec, schema_of(GENESIS)).encode(delta))
    sent = machine.finish(train.window, train.base_head, blob, before, after, now=0.5)
    (update,) = [a for a in sent if isinstance(a, act.SendUpdate)]
    return update.update, blob


UPDATES = [_update(n) for n in range(2)]


def _validators() -> dict[bytes, Participant]:
    return {
        who.public_key: Participant(MANIFEST, who, GENESIS, validator=True, reducers=(), now=0.0)
        for who in (A, B)
    }


def _of(actions: list[act.Action], kind: type[act.Action]) -> list[act.Action]:
    return [a for a in actions if isinstance(a, kind)]


def _full_window(machines: dict[bytes, Participant]) -> dict[bytes, list[act.Action]]:
    """Both updates to both validators: the window is full, the first proposer proposes."""
    said: dict[bytes, list[act.Action]] = {}
    for key, machine in machines.items():
        said[key] = []
        for n, (signed, blob) in enumerate(UPDATES):
            said[key] += machine.receive_update(1.0 + n, signed, blob)
    return said


def _exchange(
    machines: dict[bytes, Participant], said: dict[bytes, list[act.Action]], now: float
) -> dict[bytes, list[act.Action]]:
    """Each machine's votes delivered to the others, until nobody says a new one; what each
    said on the way."""
    heard: dict[bytes, list[act.Action]] = {key: [] for key in machines}
    pending = {key: _of(actions, act.SendAttestation) for key, actions in said.items()}
    while any(pending.values()):
        sent, pending = pending, {key: [] for key in machines}
        for source, votes in sent.items():
            for vote in votes:
                assert isinstance(vote, act.SendAttestation)
                for key, machine in machines.items():
                    if key != source:
                        answer = machine.receive_attestation(now, vote.attestation)
                        heard[key] += answer
                        pending[key] += _of(answer, act.SendAttestation)
    return heard


def test_two_validators_certify_a_window_and_each_counts_its_own_vote_once() -> None:
    machines = _validators()
    said = _full_window(machines)
    (proposer,) = [k for k, actions in said.items() if _of(actions, act.SendProposal)]
    (other,) = [k for k in machines if k != proposer]
    (proposal,) = _of(said[proposer], act.SendProposal)
    (own_vote,) = _of(said[proposer], act.SendAttestation)
    assert isinstance(proposal, act.SendProposal) and isinstance(own_vote, act.SendAttestation)
    assert not _of(said[proposer], act.SendCertificate)  # one vote of two

    # its own vote handed back (as gossip would) is already counted: nothing happens
    again = machines[proposer].receive_attestation(3.0, own_vote.attestation)
    assert again == []
    assert machines[proposer].window == 1

    # the other validator re-derives the head from the same updates and prevotes it too
    judged = machines[other].receive_proposal(3.0, proposal.proposal)
    (vote,) = _of(judged, act.SendAttestation)
    assert isinstance(vote, act.SendAttestation)
    assert vote.attestation.record.head_id == proposal.proposal.record.head.id
    assert (vote.attestation.record.stage, vote.attestation.record.round) == ("prevote", 0)
    assert machines[other].statistics().proposals_wrong == 0

    # each one's prevote makes q for the head: both commit it, and the commits certify it
    heard = _exchange(machines, {proposer: [own_vote], other: [vote]}, 4.0)
    for key in machines:
        stages = [
            a.attestation.record.stage for a in heard[key] if isinstance(a, act.SendAttestation)
        ]
        assert stages == ["commit"]
        assert _of(heard[key], act.SendCertificate)
    assert machines[proposer].window == machines[other].window == 2
    tips = {m.chain.tip.head_id for m in machines.values()}
    assert tips == {proposal.proposal.record.head.id}
    # each reduced the window once and verified the certificate once
    for machine in machines.values():
        statistics = machine.statistics()
        assert (statistics.outer_steps, statistics.certificate_checks) == (1, 1)
        assert statistics.reductions == 1


def test_a_proposal_whose_head_the_updates_do_not_make_is_not_attested() -> None:
    machines = _validators()
    said = _full_window(machines)
    (proposer,) = [k for k, actions in said.items() if _of(actions, act.SendProposal)]
    (other,) = [k for k in machines if k != proposer]
    (sent,) = _of(said[proposer], act.SendProposal)
    assert isinstance(sent, act.SendProposal)
    honest = sent.proposal.record
    forged_head = msgspec.structs.replace(honest.head, weights_blob=h("other weights"))
    liar = A if proposer == A.public_key else B
    forged = seal(liar, msgspec.structs.replace(honest, head=forged_head))

    judged = machines[other].receive_proposal(3.0, forged)
    voted = {a.attestation.record.head_id for a in judged if isinstance(a, act.SendAttestation)}
    assert forged.record.head.id not in voted  # (it may vote for its own honest head)
    (blamed,) = _of(judged, act.Reported)
    assert isinstance(blamed, act.Reported) and blamed.peer_id == liar.peer_id
    assert machines[other].statistics().proposals_wrong == 1


def test_a_proposal_for_another_window_is_not_taken() -> None:
    machines = _validators()
    said = _full_window(machines)
    (proposer,) = [k for k, actions in said.items() if _of(actions, act.SendProposal)]
    (other,) = [k for k in machines if k != proposer]
    (sent,) = _of(said[proposer], act.SendProposal)
    assert isinstance(sent, act.SendProposal)
    liar = A if proposer == A.public_key else B
    honest = sent.proposal.record
    later: Proposal = msgspec.structs.replace(
        honest,
        window=5,
        base_head=h("a later base"),
        head=msgspec.structs.replace(honest.head, height=5, parent=h("a later base")),
    )
    assert machines[other].receive_proposal(3.0, seal(liar, later)) == []
    assert not machines[other].holds_proposal(seal(liar, later))
    assert machines[other].statistics().proposals_wrong == 0  # not judged: not this window


def test_a_trainer_and_a_validator_of_one_node_follow_one_chain() -> None:
    """Roles composed over one follower: the validator's reduction is the head both adopt
    (one outer step, one certificate check, one copy of the weights), and the trainer learns
    of the new base from the node (on_base), which asks it to train the next window."""
    follower = Follower(MANIFEST, A, GENESIS)
    validator = Participant(MANIFEST, A, follower, validator=True, reducers=(), now=0.0)
    trainer = TrainerMachine(MANIFEST, A, follower)
    other = Participant(MANIFEST, B, GENESIS, validator=True, reducers=(), now=0.0)
    machines = {A.public_key: validator, B.public_key: other}
    said = _full_window(machines)
    (proposer,) = [k for k, actions in said.items() if _of(actions, act.SendProposal)]
    (judge,) = [k for k in machines if k != proposer]
    (proposal,) = _of(said[proposer], act.SendProposal)
    assert isinstance(proposal, act.SendProposal)
    judged = machines[judge].receive_proposal(3.0, proposal.proposal)
    # A needs the votes of B: B's own (B proposed) or B's judgement of A's proposal
    said[judge] = judged
    adopted = _exchange(machines, said, 4.0)[A.public_key]
    assert _of(adopted, act.Adopted) and not _of(adopted, act.Train)  # the trainer's own
    assert trainer.base is validator.base is follower.base and trainer.chain.height == 1
    (train,) = trainer.on_base(4.0)
    assert isinstance(train, act.Train) and train.window == 2
    statistics = follower.statistics()
    assert (statistics.outer_steps, statistics.certificate_checks) == (1, 1)
    assert trainer.statistics().outer_steps == 1


def test_a_node_holds_one_participant() -> None:
    follower = Follower(MANIFEST, A, GENESIS)
    Participant(MANIFEST, A, follower, validator=True, reducers=(), now=0.0)
    with pytest.raises(ValueError, match="one participant"):
        Participant(MANIFEST, A, follower, validator=False, reducers=(), now=0.0)


def _clock(*readings: float) -> Callable[[], float]:
    """A timer that reads ``readings`` in turn (and raises once they run out)."""
    left = iter(readings)
    return lambda: next(left)


def test_each_reduction_is_timed_and_the_last_one_kept() -> None:
    """The proposer times its own reduction, the judge its recomputation of the proposal:
    each reads its timer once before and once after, and a cohort reduced again (the
    cached reduction) reads it no more."""
    machines = {
        A.public_key: Participant(
            MANIFEST, A, GENESIS, validator=True, reducers=(), timer=_clock(10.0, 10.25)
        ),
        B.public_key: Participant(
            MANIFEST, B, GENESIS, validator=True, reducers=(), timer=_clock(20.0, 20.5)
        ),
    }
    said = _full_window(machines)
    (proposer,) = [k for k, actions in said.items() if _of(actions, act.SendProposal)]
    (judge,) = [k for k in machines if k != proposer]
    (sent,) = _of(said[proposer], act.SendProposal)
    assert isinstance(sent, act.SendProposal)
    accepted = len(sent.proposal.record.accepted)
    assert accepted == 2
    took = 0.25 if proposer == A.public_key else 0.5
    assert machines[proposer].last_reduction == ReductionTiming(
        window=1, seconds=took, accepted=2, count=1, total_seconds=took
    )
    # the judge's proposer had not proposed at the close: it reduced its own cohort then
    # (PREPARE), and judging the proposal of that cohort reads the timer no more
    took = 0.5 if judge == B.public_key else 0.25
    prepared = ReductionTiming(window=1, seconds=took, accepted=2, count=1, total_seconds=took)
    assert machines[judge].last_reduction == prepared
    machines[judge].receive_proposal(3.0, sent.proposal)
    assert machines[judge].last_reduction == prepared
    assert machines[judge].statistics().reductions == 1


def test_a_timer_changes_nothing_but_the_timing() -> None:
    """Participants with a timer (the node's) and without (the simulator's, whose reports
    are compared byte for byte) say and count the same: wall seconds enter no record or
    statistic, and only the timed ones keep them."""
    plain = _validators()
    timed = {
        key: Participant(
            MANIFEST, who, GENESIS, validator=True, reducers=(), timer=_clock(1.0, 2.0, 3.0)
        )
        for key, who in ((A.public_key, A), (B.public_key, B))
    }
    assert _full_window(plain) == _full_window(timed)
    for key, machine in timed.items():  # the proposer's reduction, the judge's prepared one
        assert machine.last_reduction is not None
        assert plain[key].statistics() == machine.statistics()
        assert plain[key].statistics().reductions == 1
    assert all(m.last_reduction is None for m in plain.values())
