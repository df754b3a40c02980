"""The intake rules and the effect policy, driven by hand (no IO): what is kept before what
is sent, whom a fetch asks, when it is tried again, and what is refused at the door."""

from __future__ import annotations

import pytest

from p2ptrain.aggregate.codecs import make_encoder, max_update_bytes
from p2ptrain.core.envelope import Signed, seal
from p2ptrain.core.records import Attestation, Head, Proposal, Update
from p2ptrain.core.tensors import schema_of
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.effects import (
    BlobFetch,
    Fetch,
    Publish,
    RecordFetch,
    StoreBlob,
    StoreRecord,
    StoreVote,
    TrainLater,
    WindowSync,
)
from p2ptrain.protocol.intake import EarlyBuffer, IntakeRules
from p2ptrain.protocol.participant import Participant
from p2ptrain.protocol.policy import (
    FETCH_ATTEMPTS,
    ParticipantPolicy,
    TrainerPolicy,
    backoff,
    policy_for,
)
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.workloads import SyntheticWorkload
from tests.support.builders import h, identity, synthetic_experiment

WORKLOAD = SyntheticWorkload(seed=1)
VALIDATOR = identity(0)
MANIFEST = synthetic_experiment(WORKLOAD, VALIDATOR.public_key, max_updates=2)
GENESIS = WORKLOAD.genesis()


def _trainer(n: int) -> tuple[TrainerPolicy, act.Train]:
    policy = policy_for(TrainerMachine(MANIFEST, identity(10 + n), GENESIS))
    assert isinstance(policy, TrainerPolicy)
    (train,) = policy.start(0.0)
    assert isinstance(train, act.Train)
    return policy, train


def _update(n: int) -> tuple[Signed[Update], bytes]:
    policy, train = _trainer(n)
    delta, before, after = WORKLOAD.train(GENESIS, policy.machine.lease(1), n, 1)
    blob = make_encoder(MANIFEST.codec, schema_of(GENESIS)).encode(delta)
    effects = policy.trained(1.0, train, blob, before, after)
    store, publish = effects
    assert isinstance(store, StoreBlob) and isinstance(publish, Publish)
    assert isinstance(publish.record, Signed)
    return publish.record, blob


def _validator() -> ParticipantPolicy:
    machine = Participant(MANIFEST, VALIDATOR, GENESIS, validator=True, reducers=(), now=0.0)
    policy = policy_for(machine)
    assert isinstance(policy, ParticipantPolicy)
    return policy


def test_a_trainer_keeps_its_blob_before_it_publishes_the_update() -> None:
    policy, train = _trainer(0)
    delta, before, after = WORKLOAD.train(GENESIS, policy.machine.lease(1), 0, 1)
    blob = make_encoder(MANIFEST.codec, schema_of(GENESIS)).encode(delta)
    effects = policy.trained(1.0, train, blob, before, after)
    assert [type(e) for e in effects] == [StoreBlob, Publish]
    assert effects[0] == StoreBlob(blob)
    assert isinstance(effects[1], Publish) and effects[1].blob == blob


def test_a_failed_training_is_offered_again_after_a_back_off_unless_the_head_moved() -> None:
    policy, train = _trainer(0)
    (later,) = policy.train_failed(1.0, train, failures_in_a_row=2)
    assert later == TrainLater(train, 4.0)
    assert policy.train_due(5.0, train) == [train]
    moved = act.Train(train.window, h("another head"))
    assert policy.train_due(5.0, moved) == []


def test_an_update_is_fetched_from_its_trainer_and_kept_once_the_window_took_it() -> None:
    policy = _validator()
    signed, blob = _update(0)
    (fetch,) = policy.record(2.0, signed, 100)
    assert isinstance(fetch, Fetch) and isinstance(fetch.request, BlobFetch)
    assert fetch.request.first == (signed.record.trainer_id,) and fetch.delay_s == 0
    assert policy.record(2.0, signed, 100) == []  # already being fetched
    effects = policy.fetched(3.0, fetch.request, blob)
    assert effects[0] == StoreRecord(signed, "update", 1)


def test_a_fetch_lost_in_transit_backs_off_then_asks_anyone_and_a_proven_bad_one_stops() -> None:
    policy = _validator()
    signed, _blob = _update(0)
    (fetch,) = policy.record(2.0, signed, 100)
    assert isinstance(fetch, Fetch)
    request = fetch.request
    delays, firsts = [], []
    for _ in range(FETCH_ATTEMPTS - 1):
        (again,) = policy.fetch_failed(3.0, request, proven_bad=False)
        assert isinstance(again, Fetch) and isinstance(again.request, BlobFetch)
        delays.append(again.delay_s)
        firsts.append(again.request.first)
        request = again.request
    assert delays == [backoff(a) for a in range(FETCH_ATTEMPTS - 1)]
    assert delays == sorted(delays) and max(delays) <= 5.0
    assert firsts[0] and not firsts[-1]  # the trainer first, then anyone
    assert policy.fetch_failed(3.0, request, proven_bad=False) == []  # given up
    (fetch,) = policy.record(4.0, signed, 100)  # asked again later: fetched anew
    assert policy.fetch_failed(5.0, fetch.request, proven_bad=True) == []


def test_a_validator_stores_its_vote_before_it_attests() -> None:
    policy = _validator()
    effects = []
    for n in range(2):  # the window is full at two updates: it closes and reduces now
        signed, blob = _update(n)
        (fetch,) = policy.record(2.0, signed, 100)
        assert isinstance(fetch, Fetch)
        effects += policy.fetched(2.0 + n, fetch.request, blob)
    kinds = [type(e).__name__ for e in effects]
    vote = kinds.index("StoreVote")
    attestation = next(
        i for i, e in enumerate(effects) if isinstance(e, Publish) and e.kind == "attestation"
    )
    assert vote < attestation
    proposal = next(
        i for i, e in enumerate(effects) if isinstance(e, Publish) and e.kind == "proposal"
    )
    stored_blobs = [i for i, e in enumerate(effects) if isinstance(e, StoreBlob)]
    assert stored_blobs and min(stored_blobs) < proposal  # the head's blobs before the proposal
    assert isinstance(effects[vote], StoreVote) and effects[vote].height == 1


def test_records_for_the_next_window_wait_in_a_bounded_buffer_and_replay_when_it_opens() -> None:
    policy = _validator()
    future, _ = _update(0)
    early = Update(**{**{f: getattr(future.record, f) for f in future.record.__struct_fields__},
                      "window": 2})  # fmt: skip
    signed = seal(identity(10), early)
    assert policy.record(2.0, signed, 100) == []
    assert len(policy.early) == 1
    assert policy.early.take(2) == [signed]


def test_the_early_buffer_is_bounded_per_signer_and_in_total() -> None:
    buffer: EarlyBuffer[str] = EarlyBuffer(per_signer_bytes=100, total_bytes=150)
    assert buffer.add("a", 2, "alice", 60, "a")
    assert not buffer.add("b", 2, "alice", 60, "b")  # alice's share is full
    assert buffer.add("c", 2, "bob", 60, "c")
    assert not buffer.add("d", 2, "carol", 60, "d")  # the total is full
    assert buffer.bytes == 120 and len(buffer) == 2
    assert buffer.take(3) == []  # window 2's records are stale by window 3: dropped
    assert buffer.bytes == 0 and buffer.add("d", 4, "carol", 60, "d")


def _rules() -> IntakeRules:
    return IntakeRules(
        MANIFEST, MANIFEST.id, max_update_bytes=max_update_bytes(MANIFEST.codec, schema_of(GENESIS))
    )


def _proposal(signer: int, window: int = 1) -> Signed[Proposal]:
    base = h("base")
    head = Head(experiment_id=MANIFEST.id, height=window, parent=base,
                weights_blob=h("w"), optimizer_blob=None, aggregate_blob=h("agg"))  # fmt: skip
    proposal = Proposal(experiment_id=MANIFEST.id, window=window, base_head=base,
                        reducer=identity(signer).public_key, accepted=(), rejected=(),
                        aggregate_blob=h("agg"), head=head)  # fmt: skip
    return seal(identity(signer), proposal)


def test_intake_rejects_what_the_signer_had_no_right_to_send_and_blames_the_signer() -> None:
    rules = _rules()
    outsider = _proposal(77)
    verdict = rules.judge(outsider, open_window=1)
    assert not verdict.accepted and verdict.blame == identity(77).peer_id
    assert "neither a reducer nor a validator" in verdict.reason
    assert rules.judge(_proposal(0), open_window=1).accepted  # the validator may propose
    stranger = seal(identity(5), Attestation(experiment_id=MANIFEST.id, height=1,
                    head_id=h("x"), validator=identity(5).public_key, round=0,
                    stage="commit"))  # fmt: skip
    assert rules.judge(stranger, open_window=1).blame == identity(5).peer_id


def test_intake_refuses_the_records_of_a_revoked_key_without_blaming_the_forwarder() -> None:
    rules = _rules()
    assert rules.judge(_proposal(0), open_window=1).accepted
    rules.revoked = {identity(0).public_key}
    verdict = rules.judge(_proposal(0), open_window=1)
    assert not verdict.accepted and verdict.blame is None
    assert "revoked" in verdict.reason


@pytest.mark.parametrize(("window", "accepted"), [(1, True), (2, True), (3, False), (50, False)])
def test_intake_ignores_records_far_ahead_without_blaming_anyone(
    window: int, accepted: bool
) -> None:
    verdict = _rules().judge(_proposal(0, window), open_window=1)
    assert verdict.accepted is accepted
    assert verdict.blame is None


def test_intake_rejects_updates_the_experiment_cannot_use() -> None:
    rules = _rules()
    signed, _ = _update(0)
    fields = {f: getattr(signed.record, f) for f in signed.record.__struct_fields__}
    assert rules.judge(signed, open_window=1).accepted
    for change, reason in [
        ({"lease_shards": ("no-such-shard",)}, "shards"),
        ({"codec": "int8"}, "codec"),
        ({"delta_bytes": 1 << 40}, "bound"),
    ]:
        bad = seal(identity(10), Update(**{**fields, **change}))
        verdict = rules.judge(bad, open_window=1)
        assert verdict.rejected and reason in verdict.reason, verdict


def test_a_proposal_names_missing_updates_fetched_from_its_proposer() -> None:
    policy = _validator()
    effects = policy.effects_of(1.0, act.FetchUpdates(identity(3).public_key, (h("u1"), h("u2"))))
    assert [e.request for e in effects if isinstance(e, Fetch)] == [
        RecordFetch(h("u1"), identity(3).peer_id, 1),
        RecordFetch(h("u2"), identity(3).peer_id, 1),
    ]


def test_a_proposal_update_fetch_stops_once_its_window_is_over() -> None:
    policy = _validator()
    current = RecordFetch(h("u1"), identity(3).peer_id, 1)
    (again,) = policy.fetch_failed(1.0, current, proven_bad=False)
    assert isinstance(again, Fetch) and again.delay_s == backoff(0)
    over = RecordFetch(h("u1"), identity(3).peer_id, 0)
    assert policy.fetch_failed(1.0, over, proven_bad=False) == []


def test_an_update_no_proposal_named_is_sent_again_once_after_the_first_slot() -> None:
    policy, train = _trainer(0)
    delta, before, after = WORKLOAD.train(GENESIS, policy.machine.lease(1), 0, 1)
    blob = make_encoder(MANIFEST.codec, schema_of(GENESIS)).encode(delta)
    _, publish = policy.trained(1.0, train, blob, before, after)
    assert isinstance(publish, Publish) and not publish.again
    timing = MANIFEST.window
    due = 1.0 + timing.deadline_s + timing.proposal_s  # sent at 1.0: the deadline after it
    assert policy.machine.next_wakeup(2.0) == due
    assert policy.tick(due - 0.01) == []
    again = policy.tick(due)
    assert [type(e) for e in again] == [StoreBlob, Publish]
    assert isinstance(again[1], Publish) and again[1].again
    assert again[1].record == publish.record
    assert policy.tick(due + 100.0) == []  # once
    assert policy.machine.next_wakeup(due + 100.0) is None


def test_an_update_a_proposal_named_is_not_sent_again() -> None:
    policy, train = _trainer(0)
    delta, before, after = WORKLOAD.train(GENESIS, policy.machine.lease(1), 0, 1)
    blob = make_encoder(MANIFEST.codec, schema_of(GENESIS)).encode(delta)
    _, publish = policy.trained(1.0, train, blob, before, after)
    assert isinstance(publish, Publish) and isinstance(publish.record, Signed)
    validator = _validator()
    validator.fetched(2.0, BlobFetch(publish.record, ()), blob)
    effects = validator.tick(2.0 + MANIFEST.window.deadline_s)  # the deadline: it proposes
    (proposal,) = [e for e in effects if isinstance(e, Publish) and e.kind == "proposal"]
    assert isinstance(proposal.record, Signed)
    assert policy.record(3.0, proposal.record, 0) == []
    assert policy.machine.next_wakeup(3.0) is None
    assert policy.tick(1e6) == []


def test_a_stuck_window_asks_peers_what_it_holds_and_whether_the_chain_moved() -> None:
    policy = _validator()
    timing = MANIFEST.window
    assert policy.tick(timing.deadline_s) == []  # slot 0: no updates, nothing to propose
    effects = policy.tick(timing.deadline_s + timing.proposal_s)  # slot 1: still stuck
    syncs = [e.request for e in effects if isinstance(e, Fetch)]
    assert [type(r).__name__ for r in syncs] == ["WindowSync", "ChainFetch"]
    window_sync = syncs[0]
    assert isinstance(window_sync, WindowSync)
    assert window_sync.window == 1 and window_sync.held == frozenset()
    assert policy.tick(timing.deadline_s + timing.proposal_s + 0.1) == []  # once a slot
