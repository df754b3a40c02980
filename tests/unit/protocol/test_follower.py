"""A follower holding a head's parent downloads only the aggregate: it steps its own
weights and momentum, adopts the result only when it hashes to the certified head, and
otherwise (or when nobody serves the aggregate) fetches the full state."""

from __future__ import annotations

import msgspec
import torch

from p2ptrain.aggregate.codecs import make_encoder
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import seal
from p2ptrain.core.manifests import AggregationSpec, ExperimentManifest
from p2ptrain.core.records import Update
from p2ptrain.core.tensors import schema_of
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.effects import AggregateFetch, Fetch, StateFetch
from p2ptrain.protocol.follower import Follower
from p2ptrain.protocol.leases import LeaseBook, lease_for
from p2ptrain.protocol.policy import AGGREGATE_ATTEMPTS, RolePolicy
from p2ptrain.protocol.reduction import BaseState, Reduction, Submission, reduce_window
from p2ptrain.sim.workloads import SyntheticWorkload
from tests.support.builders import certify, identity, synthetic_experiment

VALIDATOR = identity(0)
WORKLOAD = SyntheticWorkload(seed=5)
MANIFEST = synthetic_experiment(WORKLOAD, VALIDATOR.public_key, max_updates=4)


def _reduce(base: BaseState, manifest: ExperimentManifest = MANIFEST) -> Reduction:
    """Two trainers' honest updates of the window on ``base``, reduced."""
    cohort = []
    for n in (30, 31):
        trainer = identity(n)
        lease = lease_for(manifest, base.window, trainer.peer_id)
        delta, _, _ = WORKLOAD.train(base.weights, lease, n, base.window)
        blob = make_encoder(manifest.codec, schema_of(base.weights)).encode(delta)
        update = Update(experiment_id=manifest.id, window=base.window, base_head=base.head_id,
                        trainer=trainer.public_key, lease_shards=lease.shards,
                        lease_samples=lease.samples, delta_blob=sha256_hex(blob),
                        delta_bytes=len(blob), codec=manifest.codec.name, loss_before=1.0,
                        loss_after=0.5)  # fmt: skip
        signed = seal(trainer, update)
        cohort.append(Submission(update, signed.record_id, blob))
    reduction = reduce_window(manifest, base, cohort, LeaseBook(manifest))
    assert reduction.head is not None and reduction.aggregate_blob is not None
    return reduction


def _certified(follower: Follower, reduction: Reduction) -> list[act.Action]:
    assert reduction.head is not None
    head = reduction.head
    return follower.receive_certificate(0.0, head, certify(head, [VALIDATOR]), b"\x01" * 32)


def test_two_heights_follow_from_their_aggregates_alone() -> None:
    follower = Follower(MANIFEST, identity(7), WORKLOAD.genesis())
    base = follower.base
    for height in (1, 2):  # the second step uses the momentum the first one left
        reduction = _reduce(base)
        assert reduction.head is not None and reduction.aggregate_blob is not None
        (fetch,) = _certified(follower, reduction)
        assert isinstance(fetch, act.FetchAggregate) and fetch.head_id == reduction.head_id
        actions = follower.receive_aggregate(1.0, fetch.head_id, reduction.aggregate_blob)
        assert isinstance(actions[0], act.Adopted) and actions[0].head.height == height
        base = follower.base
        assert base.head_id == reduction.head_id
        assert reduction.weights is not None and reduction.optimizer_state is not None
        assert torch.equal(base.weights["w"], reduction.weights["w"])
        assert base.optimizer_state is not None
        assert torch.equal(
            base.optimizer_state["momentum.w"], reduction.optimizer_state["momentum.w"]
        )
        # it serves what it computed: the aggregate and the full state
        assert follower.aggregate_of(base.head_id) == reduction.aggregate_blob
        assert follower.state_of(base.head_id) == (
            reduction.weights_blob,
            reduction.optimizer_blob,
        )
    assert follower.statistics().aggregates_applied == 2


def test_an_outer_step_that_differs_from_the_quorums_falls_back_to_the_full_state() -> None:
    follower = Follower(MANIFEST, identity(7), WORKLOAD.genesis())
    reduction = _reduce(follower.base)
    assert reduction.aggregate_blob is not None
    # this machine's arithmetic (here: its weights) differs from the validators'
    follower.base = BaseState(
        follower.base.head,
        follower.base.head_id,
        {"w": follower.base.weights["w"] + 1e-6},
    )
    (fetch,) = _certified(follower, reduction)
    assert isinstance(fetch, act.FetchAggregate)
    (full,) = follower.receive_aggregate(1.0, fetch.head_id, reduction.aggregate_blob)
    assert isinstance(full, act.FetchState) and full.head_id == reduction.head_id
    assert follower.base.head.height == 0  # nothing adopted from a wrong step
    assert follower.statistics().aggregate_mismatches == 1
    # bytes that are not the head's aggregate are never decoded
    (again,) = follower.receive_aggregate(1.0, fetch.head_id, b"not the aggregate")
    assert isinstance(again, act.FetchState)


def test_nobody_serving_the_aggregate_means_the_full_state_is_fetched() -> None:
    follower = Follower(MANIFEST, identity(7), WORKLOAD.genesis())
    policy = RolePolicy(follower)
    reduction = _reduce(follower.base)
    (fetch,) = policy.carry(0.0, _certified(follower, reduction))
    assert isinstance(fetch, Fetch) and isinstance(fetch.request, AggregateFetch)
    request = fetch.request
    for _ in range(AGGREGATE_ATTEMPTS - 1):
        (retry,) = policy.fetch_failed(1.0, request, proven_bad=False)
        assert isinstance(retry, Fetch) and isinstance(retry.request, AggregateFetch)
        request = retry.request
    (full,) = policy.fetch_failed(2.0, request, proven_bad=False)
    assert isinstance(full, Fetch) and isinstance(full.request, StateFetch)
    assert full.request.head_id == reduction.head_id


def test_a_follower_behind_by_a_few_heads_follows_them_link_by_link() -> None:
    follower = Follower(MANIFEST, identity(7), WORKLOAD.genesis())
    one = _reduce(follower.base)
    assert one.head is not None and one.head_id is not None and one.weights is not None
    two = _reduce(BaseState(one.head, one.head_id, one.weights, one.optimizer_state))
    assert two.head_id is not None and one.aggregate_blob and two.aggregate_blob
    _certified(follower, one)
    (still,) = _certified(follower, two)  # head 2 came before head 1's aggregate
    assert isinstance(still, act.FetchAggregate) and still.head_id == one.head_id
    adopted, following = follower.receive_aggregate(1.0, one.head_id, one.aggregate_blob)
    assert isinstance(adopted, act.Adopted) and adopted.head.height == 1
    assert isinstance(following, act.FetchAggregate) and following.head_id == two.head_id
    (last,) = follower.receive_aggregate(1.0, two.head_id, two.aggregate_blob)
    assert isinstance(last, act.Adopted) and follower.base.head_id == two.head_id
    assert follower.statistics().aggregates_applied == 2


def test_an_int8_aggregate_steps_every_machine_to_the_certified_weights() -> None:
    manifest = msgspec.structs.replace(MANIFEST, aggregation=AggregationSpec(precision="int8"))
    follower = Follower(manifest, identity(7), WORKLOAD.genesis())
    exact = _reduce(follower.base)  # the same cohort at float32 precision
    reduction = _reduce(follower.base, manifest)
    assert reduction.aggregate_blob is not None and exact.aggregate_blob is not None
    assert len(reduction.aggregate_blob) < len(exact.aggregate_blob)
    assert reduction.weights is not None and exact.weights is not None
    assert not torch.equal(reduction.weights["w"], exact.weights["w"])  # it was rounded
    (fetch,) = _certified(follower, reduction)
    assert isinstance(fetch, act.FetchAggregate)
    actions = follower.receive_aggregate(1.0, fetch.head_id, reduction.aggregate_blob)
    assert isinstance(actions[0], act.Adopted)
    assert torch.equal(follower.base.weights["w"], reduction.weights["w"])
    assert follower.statistics().aggregate_mismatches == 0
