"""The window's lifecycle table (protocol/lifecycle.py) and the participant that follows it:
the table is the only place a window changes phase, the roles differ only by their rows, and
a reducer and a validator driven by hand through an expired window, a restart by its first
update, a full close and the slots after it go through the phases the table names."""

from __future__ import annotations

import ast
import inspect

from p2ptrain.aggregate.codecs import make_encoder
from p2ptrain.core.envelope import Signed
from p2ptrain.core.records import Update
from p2ptrain.core.tensors import schema_of
from p2ptrain.protocol import actions as act
from p2ptrain.protocol import participant as participant_module
from p2ptrain.protocol.ballot import Ballot
from p2ptrain.protocol.lifecycle import (
    EFFECTS,
    EVENTS,
    PHASES,
    TRANSITIONS,
    Effect,
    Event,
    Phase,
    Role,
    transition,
)
from p2ptrain.protocol.participant import Participant
from p2ptrain.protocol.proposers import proposer_order
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.workloads import SyntheticWorkload
from tests.support.builders import identity, synthetic_experiment

WORKLOAD = SyntheticWorkload(seed=8)
VALIDATOR, REDUCER = identity(1), identity(2)
MANIFEST = synthetic_experiment(WORKLOAD, VALIDATOR.public_key, max_updates=2)
GENESIS = WORKLOAD.genesis()
TRAINERS = [identity(40 + n) for n in range(2)]
DEADLINE_S = MANIFEST.window.deadline_s
SLOT_S = MANIFEST.window.proposal_s


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


def _of(actions: list[act.Action], kind: type[act.Action]) -> list[act.Action]:
    return [a for a in actions if isinstance(a, kind)]


def _reachable(role: Role) -> set[Phase]:
    seen, todo = {Phase.OPEN}, [Phase.OPEN]
    while todo:
        phase = todo.pop()
        for (source, _), step in TRANSITIONS[role].items():
            if source is phase and step.phase not in seen:
                seen.add(step.phase)
                todo.append(step.phase)
    return seen


def test_every_phase_event_and_effect_is_described_and_each_role_reaches_its_phases() -> None:
    assert set(PHASES) == set(Phase) and set(EVENTS) == set(Event)
    assert set(EFFECTS) == set(Effect)
    common = {Phase.OPEN, Phase.EXPIRED, Phase.CLOSED, Phase.CERTIFIED}
    assert _reachable(Role.REDUCER) == common | {Phase.PROPOSED}
    assert _reachable(Role.VALIDATOR) == common | {Phase.ATTESTED}
    # a pair the table does not name changes nothing
    assert transition(Role.VALIDATOR, Phase.ATTESTED, Event.UPDATE).effects == ()
    assert transition(Role.VALIDATOR, Phase.ATTESTED, Event.UPDATE).phase is Phase.ATTESTED


def test_the_roles_differ_only_in_what_follows_a_judgement_their_own_proposal_and_votes() -> None:
    reducer, validator = TRANSITIONS[Role.REDUCER], TRANSITIONS[Role.VALIDATOR]
    differ = {
        pair
        for pair in reducer.keys() | validator.keys()
        if reducer.get(pair) != validator.get(pair)
    }
    assert {event for _, event in differ if _ is not Phase.PROPOSED} == {
        Event.VALID,
        Event.PROPOSED,
        Event.NO_HEAD,
        Event.VOTED,
        Event.ORDER_OVER,
        Event.SYNC_DUE,  # a validator that voted still asks what the window holds
        Event.ABSENT,  # a validator reduces its own cohort while the proposal is on its way
    }
    assert validator[(Phase.CLOSED, Event.ABSENT)].effects == (Effect.PREPARE,)
    assert reducer[(Phase.CLOSED, Event.ABSENT)].effects == ()
    # the close is the same for both, and defined once
    for role in Role:
        for event in (Event.FULL, Event.REPORTED, Event.DEADLINE):
            assert transition(role, Phase.OPEN, event).phase is Phase.CLOSED
        # the deadline runs from the first update, in a window that expired empty too
        for phase in (Phase.OPEN, Phase.EXPIRED):
            start = transition(role, phase, Event.FIRST_UPDATE)
            assert (start.phase, start.effects) == (Phase.OPEN, (Effect.START, Effect.JOIN))
        assert transition(role, Phase.OPEN, Event.UPDATE).effects == (Effect.JOIN,)


def _assigned_in(attribute: str) -> set[str]:
    """The functions of protocol/participant.py that assign ``<something>.attribute``."""
    tree = ast.parse(inspect.getsource(participant_module))
    where: set[str] = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            if any(isinstance(t, ast.Attribute) and t.attr == attribute for t in targets):
                where.add(function.name)
    return where


def test_only_the_table_changes_a_windows_phase_and_deadline() -> None:
    assert _assigned_in("phase") == {"_fire"}
    assert _assigned_in("deadline_at") == {"_fire"}
    assert "is_validator" not in inspect.getsource(participant_module)


def test_an_expired_window_starts_its_deadline_at_its_first_update_and_closes_full() -> None:
    machine = Participant(MANIFEST, VALIDATOR, GENESIS, validator=True, reducers=(), now=0.0)
    assert machine.phase is Phase.OPEN
    assert machine.tick(DEADLINE_S + 1.0) == []
    assert machine.phase is Phase.EXPIRED
    assert machine.waiting_for(DEADLINE_S + 1.0).startswith("window 1: no update arrived")
    # slot 1 opens: a participant still waiting asks its peers what the window holds
    synced = machine.tick(DEADLINE_S + SLOT_S + 0.5)
    assert _of(synced, act.SyncWindow) and machine.phase is Phase.EXPIRED

    late = DEADLINE_S + 2 * SLOT_S
    signed, blob = UPDATES[0]
    assert machine.receive_update(late, signed, blob) == []
    assert machine.phase is Phase.OPEN  # the deadline runs from the first update
    assert machine.next_wakeup(late) == late + DEADLINE_S
    assert machine.tick(late + DEADLINE_S - 1.0) == [] and machine.phase is Phase.OPEN

    signed, blob = UPDATES[1]
    said = machine.receive_update(late + 1.0, signed, blob)
    # full: closed at once, and the only proposer (the validator) proposes and attests
    assert _of(said, act.SendProposal) and _of(said, act.SendAttestation)
    assert _of(said, act.SendCertificate)  # q = 1: its vote certifies
    assert machine.window == 2 and machine.phase is Phase.OPEN


def test_the_deadline_runs_from_the_first_update_not_from_the_open() -> None:
    machine = Participant(MANIFEST, VALIDATOR, GENESIS, validator=True, reducers=(), now=0.0)
    assert machine.next_wakeup(0.0) == DEADLINE_S  # empty: it expires then
    first = DEADLINE_S - 1.0  # the trainers were slow to start: the first update comes late
    signed, blob = UPDATES[0]
    assert machine.receive_update(first, signed, blob) == []
    assert machine.phase is Phase.OPEN and machine.next_wakeup(first) == first + DEADLINE_S
    assert machine.tick(DEADLINE_S + 1.0) == [] and machine.phase is Phase.OPEN
    assert machine.waiting_for(first).endswith(f"deadline in {DEADLINE_S:.0f} s")
    signed, blob = UPDATES[1]  # a second trainer, later than the old deadline: it still joins
    said = machine.receive_update(DEADLINE_S + 2.0, signed, blob)
    assert _of(said, act.SendProposal) and machine.window == 2  # full, closed at once


def test_a_reducer_proposes_once_and_stops_syncing_a_validator_judges_and_attests() -> None:
    reducers = (REDUCER.public_key,)
    reducer = Participant(MANIFEST, REDUCER, GENESIS, validator=False, reducers=reducers)
    validator = Participant(MANIFEST, VALIDATOR, GENESIS, validator=True, reducers=reducers)
    order = proposer_order(MANIFEST, reducer.experiment_id, 1, reducers)
    assert order == (REDUCER.public_key, VALIDATOR.public_key)
    for machine in (reducer, validator):
        for n, (signed, blob) in enumerate(UPDATES[:1]):  # the deadline runs from 0.0
            assert machine.receive_update(0.0 + n, signed, blob) == []
    closed = DEADLINE_S + 0.5
    (proposal,) = _of(reducer.tick(closed), act.SendProposal)
    assert reducer.phase is Phase.PROPOSED
    assert validator.tick(closed) == [] and validator.phase is Phase.CLOSED
    # slot 1: the validator, still waiting, syncs; the reducer that proposed does not
    slot_1 = DEADLINE_S + SLOT_S + 0.5
    assert reducer.tick(slot_1) == [] and reducer.phase is Phase.PROPOSED
    assert isinstance(proposal, act.SendProposal)
    said = validator.receive_proposal(slot_1, proposal.proposal)
    assert _of(said, act.SyncWindow) and _of(said, act.SendAttestation)
    assert validator.window == 2  # q = 1: certified


def test_a_validator_restarted_after_its_vote_is_attested_and_sends_its_votes_again() -> None:
    machine = Participant(MANIFEST, VALIDATOR, GENESIS, validator=True, reducers=(), now=0.0)
    lock = "f" * 64  # as restored from the store: committed in round 0
    machine.restore_votes({1: Ballot(round=0, prevote=lock, commit=lock, lock=lock)}, 10.0)
    assert machine.phase is Phase.ATTESTED
    signed, blob = UPDATES[0]
    said = machine.receive_update(11.0, signed, blob)  # round 1: its lock, prevoted
    assert [(a.attestation.record.stage, a.attestation.record.round) for a in said] == [
        ("prevote", 1)
    ]
    assert machine.tick(10.0 + DEADLINE_S + 0.5) == []  # slot 0 of a one-proposer order
    again = machine.tick(10.0 + DEADLINE_S + SLOT_S + 0.5)  # past the order: sent again
    (vote,) = _of(again, act.SendAttestation)
    assert isinstance(vote, act.SendAttestation) and vote.again
    assert vote.attestation.record.head_id == lock and vote.attestation.record.round == 1
    assert machine.tick(10.0 + DEADLINE_S + SLOT_S + 1.0) == []  # once per slot


def test_a_validator_reduces_its_cohort_while_the_proposal_is_on_its_way() -> None:
    """PREPARE: at the close, with the proposer's proposal absent, a validator reduces its
    own cohort; the proposal naming the same updates is judged from that reduction (no
    second one), and a reducer waiting on an earlier proposer prepares nothing."""
    reducers = (REDUCER.public_key,)
    reducer = Participant(MANIFEST, REDUCER, GENESIS, validator=False, reducers=reducers)
    validator = Participant(MANIFEST, VALIDATOR, GENESIS, validator=True, reducers=reducers)
    for machine in (reducer, validator):
        signed, blob = UPDATES[0]
        assert machine.receive_update(0.0, signed, blob) == []
    closed = DEADLINE_S + 0.5
    assert validator.tick(closed) == [] and validator.reductions == 1  # prepared
    (proposal,) = _of(reducer.tick(closed), act.SendProposal)
    assert isinstance(proposal, act.SendProposal)
    said = validator.receive_proposal(closed + 0.1, proposal.proposal)
    assert _of(said, act.SendAttestation) and validator.reductions == 1
    for attestation in _of(said, act.SendAttestation):  # its prevote, then its commit
        assert isinstance(attestation, act.SendAttestation)
        assert attestation.attestation.record.head_id == proposal.proposal.record.head.id
