"""Trainers that never wait: with ``window.staleness = 1`` a trainer trains window w + 1
while window w is certified, its update names the older head it built on, and validators
accept it (and only within the allowance); with 0, nothing changes."""

from __future__ import annotations

import msgspec
import pytest

from p2ptrain.aggregate.codecs import make_encoder
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import seal
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Update
from p2ptrain.core.tensors import schema_of
from p2ptrain.errors import LocalError
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.leases import LeaseBook, lease_for
from p2ptrain.protocol.reduction import (
    BaseState,
    Reduction,
    Submission,
    belongs_to_window,
    reduce_window,
)
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.workloads import SyntheticWorkload
from tests.support.builders import certify, identity, synthetic_experiment

VALIDATOR = identity(0)
WORKLOAD = SyntheticWorkload(seed=9)


def _manifest(staleness: int) -> ExperimentManifest:
    manifest = synthetic_experiment(WORKLOAD, VALIDATOR.public_key, max_updates=4)
    return msgspec.structs.replace(
        manifest, window=msgspec.structs.replace(manifest.window, staleness=staleness)
    )


def _submission(
    manifest: ExperimentManifest,
    base: BaseState,
    window: int,
    n: int,
    declared: BaseState | None = None,
) -> Submission:
    """Trainer ``n``'s update of ``window`` trained from ``base``, naming ``declared`` (a
    trainer ahead of the chain trains from its own progress on an older head)."""
    trainer = identity(n)
    lease = lease_for(manifest, window, trainer.peer_id)
    delta, _, _ = WORKLOAD.train(base.weights, lease, n, window)
    blob = make_encoder(manifest.codec, schema_of(base.weights)).encode(delta)
    named = (declared or base).head_id
    update = Update(experiment_id=manifest.id, window=window, base_head=named,
                    trainer=trainer.public_key, lease_shards=lease.shards,
                    lease_samples=lease.samples, delta_blob=sha256_hex(blob),
                    delta_bytes=len(blob), codec=manifest.codec.name, loss_before=1.0,
                    loss_after=0.5)  # fmt: skip
    return Submission(update, seal(trainer, update).record_id, blob)


def _head_one(manifest: ExperimentManifest, genesis: BaseState) -> Reduction:
    cohort = [_submission(manifest, genesis, 1, n) for n in (30, 31)]
    reduction = reduce_window(manifest, genesis, cohort, LeaseBook(manifest))
    assert reduction.head is not None
    return reduction


def _adopt(machine: TrainerMachine, reduction: Reduction) -> list[act.Action]:
    head = reduction.head
    assert head is not None and reduction.aggregate_blob is not None
    (fetch,) = machine.receive_certificate(1.0, head, certify(head, [VALIDATOR]), b"\x01" * 32)
    assert isinstance(fetch, act.FetchAggregate)
    return machine.receive_aggregate(1.0, fetch.head_id, reduction.aggregate_blob)


def _finish(machine: TrainerMachine, train: act.Train) -> list[act.Action]:
    return machine.finish(train.window, train.base_head, b"blob", 2.0, 1.0, now=1.0)


def test_with_staleness_one_a_trainer_trains_ahead_and_goes_on_when_the_head_comes() -> None:
    manifest = _manifest(1)
    machine = TrainerMachine(manifest, identity(40), WORKLOAD.genesis())
    genesis = machine.base
    (first,) = machine.start(0.0)
    assert first == act.Train(1, genesis.head_id)
    sent, ahead = _finish(machine, first)
    assert isinstance(sent, act.SendUpdate)
    assert ahead == act.Train(2, genesis.head_id)  # no waiting for window 1's head
    assert machine.statistics().training_window == 2
    # head 1 arrives while window 2 trains on genesis: that work still counts
    adopted = _adopt(machine, _head_one(manifest, genesis))
    assert [type(a) for a in adopted] == [act.Adopted]
    head_one = machine.base
    sent, after = _finish(machine, ahead)
    assert isinstance(sent, act.SendUpdate)
    assert sent.update.record.window == 2 and sent.update.record.base_head == genesis.head_id
    assert after == act.Train(3, head_one.head_id)
    # two windows ahead of the chain is too far: it waits for head 2
    sent, *rest = _finish(machine, after)
    assert rest == [] and "waiting for head 2 to train window 4" in machine.last_reason
    assert machine.statistics().stale_dropped == 0


def test_with_staleness_zero_a_trainer_waits_for_each_head() -> None:
    manifest = _manifest(0)
    machine = TrainerMachine(manifest, identity(40), WORKLOAD.genesis())
    genesis = machine.base
    (first,) = machine.start(0.0)
    (sent,) = _finish(machine, first)
    assert isinstance(sent, act.SendUpdate)
    adopted, train = _adopt(machine, _head_one(manifest, genesis))
    assert isinstance(adopted, act.Adopted) and train == act.Train(2, machine.base.head_id)


def test_a_window_trained_on_a_head_too_old_is_dropped() -> None:
    manifest = _manifest(0)
    machine = TrainerMachine(manifest, identity(40), WORKLOAD.genesis())
    genesis = machine.base
    (first,) = machine.start(0.0)
    _adopt(machine, _head_one(manifest, genesis))  # head 1 came while window 1 trained
    assert _finish(machine, first) == []
    assert machine.statistics().stale_dropped == 1


def test_validators_accept_an_older_base_only_within_the_allowance() -> None:
    manifest = _manifest(1)
    genesis = TrainerMachine(manifest, identity(40), WORKLOAD.genesis()).base
    one = _head_one(manifest, genesis)
    assert one.head is not None and one.head_id is not None and one.weights is not None
    base = BaseState(one.head, one.head_id, one.weights, one.optimizer_state)
    late = _submission(manifest, base, 2, 32, declared=genesis)  # window 2, on genesis
    fresh = _submission(manifest, base, 2, 33)
    bases = (one.head_id, genesis.head_id)
    assert not belongs_to_window(manifest.id, base, late.update)  # no allowance given
    assert belongs_to_window(manifest.id, base, late.update, bases)
    reduction = reduce_window(manifest, base, [late, fresh], LeaseBook(manifest), bases)
    assert reduction.head is not None and len(reduction.accepted) == 2
    with pytest.raises(LocalError, match="builds on head"):
        reduce_window(manifest, base, [late, fresh], LeaseBook(manifest))
