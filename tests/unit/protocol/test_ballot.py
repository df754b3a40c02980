"""Voting rounds (protocol/ballot.py): two validators whose first votes split (one proposal
reached the other late) agree in the next round; a validator locked on a head it committed
prevotes no other head unless q validators prevoted that one after its lock; after a restart
it votes from the round after the stored one, for its lock."""

from __future__ import annotations

import msgspec

from p2ptrain.aggregate.codecs import make_encoder
from p2ptrain.core.envelope import Signed, seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Attestation, Update
from p2ptrain.core.tensors import schema_of
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.ballot import Ballot
from p2ptrain.protocol.lifecycle import Phase
from p2ptrain.protocol.participant import Participant
from p2ptrain.protocol.proposers import proposer_order
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.workloads import SyntheticWorkload
from tests.support.builders import identity, synthetic_experiment

WORKLOAD = SyntheticWorkload(seed=11)
GENESIS = WORKLOAD.genesis()
ONE = synthetic_experiment(WORKLOAD, identity(1).public_key, max_updates=4)
MANIFEST = msgspec.structs.replace(
    ONE, validators=tuple(sorted([identity(1).public_key, identity(2).public_key])), quorum=2
)
BY_KEY = {identity(n).public_key: identity(n) for n in (1, 2)}
#: The proposers of window 1 in slot order: FIRST proposes in slot 0, SECOND in slot 1.
FIRST, SECOND = (BY_KEY[k] for k in proposer_order(MANIFEST, MANIFEST.id, 1, ()))
TRAINERS = [identity(40 + n) for n in range(3)]
DEADLINE_S = MANIFEST.window.deadline_s
SLOT_S = MANIFEST.window.proposal_s


def _update(n: int) -> tuple[Signed[Update], bytes]:
    return _update_of(MANIFEST, n)


def _update_of(manifest: ExperimentManifest, n: int) -> tuple[Signed[Update], bytes]:
    machine = TrainerMachine(manifest, TRAINERS[n], GENESIS)
    (train,) = machine.start(0.0)
    assert isinstance(train, act.Train)
    delta, before, after = WORKLOAD.train(GENESIS, machine.lease(1), n, 1)
    blob = bytes(make_encoder(manifest.codec, schema_of(GENESIS)).encode(delta))
    sent = machine.finish(train.window, train.base_head, blob, before, after, now=0.5)
    (update,) = [a for a in sent if isinstance(a, act.SendUpdate)]
    return update.update, blob


UPDATES = [_update(n) for n in range(3)]


def _validator(who: Identity) -> Participant:
    return Participant(MANIFEST, who, GENESIS, validator=True, reducers=(), now=0.0)


def _deliver(now: float, actions: list[act.Action], to: Participant) -> list[act.Action]:
    """What ``to`` does with the proposals and votes in ``actions`` (the rest is dropped)."""
    said: list[act.Action] = []
    for action in actions:
        if isinstance(action, act.SendProposal):
            said += to.receive_proposal(now, action.proposal)
        elif isinstance(action, act.SendAttestation):
            said += to.receive_attestation(now, action.attestation)
    return said


def _votes(actions: list[act.Action]) -> list[Attestation]:
    """The votes in ``actions`` (not those sent again)."""
    return [
        a.attestation.record for a in actions if isinstance(a, act.SendAttestation) and not a.again
    ]


def _split() -> tuple[Participant, Participant, list[act.Action], list[act.Action]]:
    """FIRST holds three updates, SECOND two; FIRST's proposal is lost on its way, so SECOND
    proposes (and prevotes) its own in slot 1: round 0 is split."""
    first, second = _validator(FIRST), _validator(SECOND)
    for n, (signed, blob) in enumerate(UPDATES):  # at 0.0: the deadlines run to DEADLINE_S
        first.receive_update(0.0, signed, blob)
        if n < 2:
            second.receive_update(0.0, signed, blob)
    slot_0, slot_1 = DEADLINE_S + 0.5, DEADLINE_S + SLOT_S + 0.5
    from_first = first.tick(slot_0)  # full at three: closed on arrival, proposes in slot 0
    assert second.tick(slot_0) == []  # waits for FIRST's slot to pass
    from_second = second.tick(slot_1)
    (p1,) = [a for a in from_first if isinstance(a, act.SendProposal)]
    (p2,) = [a for a in from_second if isinstance(a, act.SendProposal)]
    # SECOND asks what the window holds, FIRST (whose proposal it lacks) among the peers asked
    (sync,) = [a for a in from_second if isinstance(a, act.SyncWindow)]
    assert sync.proposers == (FIRST.public_key,)
    assert p1.proposal.record.head.id != p2.proposal.record.head.id
    assert [(v.stage, v.round, v.head_id) for v in _votes(from_first)] == [
        ("prevote", 0, p1.proposal.record.head.id)
    ]
    assert [(v.stage, v.round, v.head_id) for v in _votes(from_second)] == [
        ("prevote", 0, p2.proposal.record.head.id)
    ]
    return first, second, from_first, from_second


def test_a_split_first_vote_is_settled_in_the_next_round_for_the_earliest_valid_proposal() -> None:
    first, second, from_first, from_second = _split()
    now = DEADLINE_S + SLOT_S + 1.0
    head_1 = next(a for a in from_first if isinstance(a, act.SendProposal)).proposal.record.head
    # everything now arrives: one prevote each for two heads, no polka, nothing committed
    assert not _votes(_deliver(now, from_first, second))
    assert not _votes(_deliver(now, from_second, first))
    assert first.phase is second.phase is Phase.ATTESTED
    # round 1 (the slots' second pass): FIRST prevotes its own again; SECOND judges FIRST's
    # proposal first, fetching the update it lacks
    round_1 = DEADLINE_S + 2 * SLOT_S + 0.5
    again_first = first.tick(round_1)
    assert ("prevote", 1, head_1.id) in [(v.stage, v.round, v.head_id) for v in _votes(again_first)]
    said = second.tick(round_1) + _deliver(round_1, again_first, second)
    (fetch,) = [a for a in said if isinstance(a, act.FetchUpdates)]
    assert fetch.update_ids == (UPDATES[2][0].record_id,)
    assert not [v for v in _votes(said) if v.round == 1]
    # the update arrives: SECOND recomputes FIRST's head, prevotes it, sees q prevotes for it
    # and commits; FIRST sees the prevote, commits, and the two commits certify the head
    said = second.receive_update(round_1 + 0.1, *UPDATES[2])
    assert [(v.stage, v.round) for v in _votes(said)] == [("prevote", 1), ("commit", 1)]
    back = _deliver(round_1 + 0.2, said, first)
    assert [(v.stage, v.round, v.head_id) for v in _votes(back)] == [("commit", 1, head_1.id)]
    (certified,) = [a for a in back if isinstance(a, act.SendCertificate)]
    assert certified.head == head_1 and certified.certificate.round == 1
    assert certified.certificate.verify(MANIFEST)
    _deliver(round_1 + 0.3, back, second)
    assert first.window == second.window == 2
    assert first.base.head_id == second.base.head_id == head_1.id


def test_a_validator_follows_another_into_a_later_round() -> None:
    # q = n = 2: one validator in a later round is enough (n - q + 1 = 1)
    first, second, from_first, from_second = _split()
    now = DEADLINE_S + SLOT_S + 1.0
    head_2 = next(a for a in from_second if isinstance(a, act.SendProposal)).proposal.record.head
    _deliver(now, from_first, second)
    _deliver(now, from_second, first)
    later = seal(FIRST, Attestation(experiment_id=MANIFEST.id, height=1, head_id=head_2.id,
                 validator=FIRST.public_key, round=5, stage="prevote"))  # fmt: skip
    said = second.receive_attestation(now + 0.1, later)  # its own clock says round 0
    assert second.votes[1].round == 5
    # in round 5 SECOND judges FIRST's earlier proposal first: it fetches what it lacks
    assert [a.update_ids for a in said if isinstance(a, act.FetchUpdates)] == [
        (UPDATES[2][0].record_id,)
    ]


def test_a_locked_validator_prevotes_its_lock_until_q_prevote_another_head_later() -> None:
    first, _, from_first, from_second = _split()
    now = DEADLINE_S + SLOT_S + 1.0
    head_1 = next(a for a in from_first if isinstance(a, act.SendProposal)).proposal.record.head
    head_2 = next(a for a in from_second if isinstance(a, act.SendProposal)).proposal.record.head
    # SECOND prevotes FIRST's head too in round 0 (forged here: SECOND's own key) -> polka:
    # FIRST commits head_1 and locks on it; the commit of SECOND never comes
    polka = seal(SECOND, Attestation(experiment_id=MANIFEST.id, height=1, head_id=head_1.id,
                 validator=SECOND.public_key, round=0, stage="prevote"))  # fmt: skip
    said = first.receive_attestation(now, polka)
    assert [(v.stage, v.round) for v in _votes(said)] == [("commit", 0)]
    assert (first.votes[1].lock, first.votes[1].lock_round) == (head_1.id, 0)
    _deliver(now, from_second, first)  # SECOND's proposal arrives: FIRST holds both
    # round 1: SECOND prevotes head_2 alone -> no polka; FIRST stays with its lock
    alone = seal(SECOND, Attestation(experiment_id=MANIFEST.id, height=1, head_id=head_2.id,
                 validator=SECOND.public_key, round=1, stage="prevote"))  # fmt: skip
    said = first.receive_attestation(now + 1, alone)
    assert [(v.stage, v.round, v.head_id) for v in _votes(said)] == [("prevote", 1, head_1.id)]
    assert first.votes[1].commit is None and first.votes[1].lock == head_1.id


def test_a_restarted_validator_votes_from_the_next_round_for_its_lock() -> None:
    _, _, from_first, _ = _split()
    head_1 = next(a for a in from_first if isinstance(a, act.SendProposal)).proposal.record.head
    stored = Ballot(round=3, prevote=head_1.id, commit=head_1.id, lock=head_1.id, lock_round=3)
    machine = _validator(FIRST)
    machine.restore_votes({1: stored}, 200.0)
    assert machine.phase is Phase.ATTESTED
    assert machine.votes[1] == Ballot(round=4, lock=head_1.id, lock_round=3)
    said = machine.tick(200.5)
    assert [(v.stage, v.round, v.head_id) for v in _votes(said)] == [("prevote", 4, head_1.id)]
    stores = [a.ballot for a in said if isinstance(a, act.SendAttestation)]
    assert stores == [Ballot(round=4, prevote=head_1.id, lock=head_1.id, lock_round=3)]


def test_a_locked_validator_sends_the_prevotes_that_locked_it_again() -> None:
    first, _, from_first, _ = _split()
    now = DEADLINE_S + SLOT_S + 1.0
    head_1 = next(a for a in from_first if isinstance(a, act.SendProposal)).proposal.record.head
    polka = seal(SECOND, Attestation(experiment_id=MANIFEST.id, height=1, head_id=head_1.id,
                 validator=SECOND.public_key, round=0, stage="prevote"))  # fmt: skip
    first.receive_attestation(now, polka)
    assert first.votes[1].lock_round == 0
    first.tick(DEADLINE_S + 2 * SLOT_S + 0.5)  # round 1: its lock, prevoted again
    again = first.tick(DEADLINE_S + 3 * SLOT_S + 0.5)  # a slot past the order: resent
    sent = {
        (a.attestation.record.validator, a.attestation.record.stage, a.attestation.record.round)
        for a in again
        if isinstance(a, act.SendAttestation) and a.again
    }
    assert sent == {
        (FIRST.public_key, "prevote", 1),  # this round's vote
        (FIRST.public_key, "prevote", 0),  # and the q prevotes of the round it locked in
        (SECOND.public_key, "prevote", 0),
    }


THREE = msgspec.structs.replace(
    ONE, validators=tuple(sorted(identity(n).public_key for n in (1, 2, 3))), quorum=2
)


def test_an_unlocked_validator_prevotes_the_latest_polka_over_the_earliest_proposal() -> None:
    keys = {identity(n).public_key: identity(n) for n in (1, 2, 3)}
    a, b, v = (keys[k] for k in proposer_order(THREE, THREE.id, 1, ()))
    updates = [_update_of(THREE, n) for n in range(3)]
    machines = {
        who: Participant(THREE, who, GENESIS, validator=True, reducers=(), now=0.0)
        for who in (a, b, v)
    }
    for n, (signed, blob) in enumerate(updates):
        for who, machine in machines.items():
            if n < 2 or who is not b:  # b holds two updates, a and v three
                machine.receive_update(0.0, signed, blob)
    slot = [DEADLINE_S + i * SLOT_S + 0.5 for i in range(12)]
    (p_a,) = [x for x in machines[a].tick(slot[0]) if isinstance(x, act.SendProposal)]
    machines[b].tick(slot[0])
    (p_b,) = [x for x in machines[b].tick(slot[1]) if isinstance(x, act.SendProposal)]
    head_1, head_2 = p_a.proposal.record.head.id, p_b.proposal.record.head.id
    # v hears b's proposal in time and a's only after its own slot: it prevotes head_2
    first = machines[v].receive_proposal(slot[1], p_b.proposal)
    assert [(x.stage, x.round, x.head_id) for x in _votes(first)] == [("prevote", 0, head_2)]
    machines[v].receive_proposal(slot[2], p_a.proposal)
    # round 1: a's proposal is the earliest v recomputed, and no polka is known
    round_1 = machines[v].tick(slot[3])
    assert [(x.stage, x.round, x.head_id) for x in _votes(round_1)] == [("prevote", 1, head_1)]
    round_2 = machines[v].tick(slot[6])
    assert [(x.stage, x.round, x.head_id) for x in _votes(round_2)] == [("prevote", 2, head_1)]
    # relayed late: a and b prevoted head_2 in round 1 (a polka; they may be locked on it)
    for who in (a, b):
        relayed = seal(who, Attestation(experiment_id=THREE.id, height=1, head_id=head_2,
                       validator=who.public_key, round=1, stage="prevote"))  # fmt: skip
        assert not _votes(machines[v].receive_attestation(slot[6] + 0.1, relayed))
    round_3 = machines[v].tick(slot[9])
    assert [(x.stage, x.round, x.head_id) for x in _votes(round_3)] == [("prevote", 3, head_2)]
