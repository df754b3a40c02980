"""Reducing a window: hand-computed heads, every kind of rejection, order independence."""

from __future__ import annotations

import gc
import hashlib
import random
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from p2ptrain.aggregate.aggregate_blob import decode_aggregate, encode_aggregate
from p2ptrain.aggregate.codecs import make_encoder
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import (
    AggregationSpec,
    CodecSpec,
    DatasetManifest,
    ExperimentManifest,
    OuterOptimizerSpec,
    ShardInfo,
    WindowSpec,
)
from p2ptrain.core.reasons import Code, Reason
from p2ptrain.core.records import Head, QuarantineEntry, Update
from p2ptrain.core.spool import SpooledBlob
from p2ptrain.core.tensors import encode_state_dict, schema_of
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.protocol import reduction
from p2ptrain.protocol.chain import genesis_head
from p2ptrain.protocol.leases import LeaseBook, lease_for
from p2ptrain.protocol.reduction import (
    BaseState,
    Reduction,
    Submission,
    blob_ids,
    reduce_window,
)
from p2ptrain.store.blobs import BlobStore
from p2ptrain.store.spool import FileSpool
from tests.support.builders import experiment, h, identity

Tensors = dict[str, torch.Tensor]

VALIDATORS = [identity(i) for i in range(3)]
TRAINERS = [identity(200 + i) for i in range(8)]
HONEST = TRAINERS[:4]
BAD = TRAINERS[4]

MANIFEST = msgspec.structs.replace(
    experiment(VALIDATORS, quorum=2),
    dataset=DatasetManifest(
        name="digits",
        shards=tuple(
            ShardInfo(name=f"shard-{i}", blob_id=h(f"shard-{i}"), samples=10) for i in range(8)
        ),
    ),
    lease_size=25,
    protocol="fedavg",
    outer_optimizer=OuterOptimizerSpec(name="sgd", lr=1.0, momentum=0.0),
    codec=CodecSpec(name="fp32"),
    aggregation=AggregationSpec(rule="mean"),
    window=WindowSpec(min_updates=1, max_updates=20),
)
GENESIS = genesis_head(MANIFEST)


def base_weights() -> Tensors:
    """A tiny model state; every value a multiple of 1/4, so the mean and the step below
    are exact in float32."""
    return {
        "w": (torch.arange(12, dtype=torch.float32).reshape(4, 3) - 6.0) * 0.5,
        "b": torch.tensor([1.0, -1.0, 0.25], dtype=torch.float32),
    }


SCHEMA = schema_of(base_weights())
GENESIS_BASE = BaseState(GENESIS, GENESIS.id, base_weights())


def delta(i: int, scale: float = 1.0) -> Tensors:
    """Trainer i's pseudo-gradient: a shared direction plus a small individual part, all
    multiples of 1/4 (so four of them average exactly)."""
    w = torch.full((4, 3), 0.5, dtype=torch.float32)
    w[i % 4, i % 3] += 0.25 * (i + 1)
    b = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float32)
    b[i % 3] -= 0.25
    return {"w": w * scale, "b": b * scale}


def encode(tensors: Mapping[str, torch.Tensor], codec: str = "fp32") -> bytes:
    return make_encoder(CodecSpec(name=codec), SCHEMA).encode(tensors)


def submit(
    trainer: Identity,
    tensors: Mapping[str, torch.Tensor],
    *,
    base: BaseState = GENESIS_BASE,
    manifest: ExperimentManifest = MANIFEST,
    blob: bytes | None = None,
    sent_blob: bytes | None = None,
    **changes: object,
) -> Submission:
    """A signed honest update of ``tensors`` for the window on ``base``; ``blob`` replaces
    the encoded tensors (the update names it), ``sent_blob`` is what arrives instead of
    the named blob, ``changes`` alter the update's fields."""
    window = base.window
    lease = lease_for(manifest, window, trainer.peer_id)
    named = encode(tensors) if blob is None else blob
    fields: dict[str, object] = {
        "experiment_id": manifest.id,
        "window": window,
        "base_head": base.head_id,
        "trainer": trainer.public_key,
        "lease_shards": lease.shards,
        "lease_samples": lease.samples,
        "delta_blob": sha256_hex(named),
        "delta_bytes": len(named),
        "codec": manifest.codec.name,
        "loss_before": 2.0,
        "loss_after": 1.5,
    }
    fields.update(changes)
    signed = seal(trainer, Update(**fields))  # type: ignore[arg-type]
    assert signed.record_id == signed.record.id
    return Submission(signed.record, signed.record_id, named if sent_blob is None else sent_blob)


def honest_cohort(base: BaseState = GENESIS_BASE) -> list[Submission]:
    return [submit(t, delta(i), base=base) for i, t in enumerate(HONEST)]


def reduce(
    cohort: Sequence[Submission],
    base: BaseState = GENESIS_BASE,
    manifest: ExperimentManifest = MANIFEST,
) -> Reduction:
    return reduce_window(manifest, base, cohort, LeaseBook(manifest))


def expected_weights(base: Mapping[str, torch.Tensor], indices: Sequence[int]) -> Tensors:
    """base - mean(deltas): outer SGD with lr 1 on the (equal-weight) mean."""
    deltas = [delta(i) for i in indices]
    return {name: base[name] - sum(d[name] for d in deltas) / len(deltas) for name in base}


def assert_same_tensors(actual: Mapping[str, torch.Tensor], expected: Tensors) -> None:
    assert set(actual) == set(expected)
    for name, value in expected.items():
        assert actual[name].dtype == torch.float32
        assert torch.equal(actual[name], value), f"{name}: {actual[name]} != {value}"


def rejection_reasons(result: Reduction) -> dict[str, str]:
    """Each rejection's reason in words."""
    return {r.update_id: r.describe() for r in result.rejected}


def standing(head: Head, trainer: Identity) -> QuarantineEntry | None:
    return next((e for e in head.quarantine if e.peer_id == trainer.peer_id), None)


# ----------------------------------------------------------------------- honest cohorts


def test_the_head_of_an_honest_cohort_is_the_hand_computed_one() -> None:
    cohort = honest_cohort()
    result = reduce(cohort)
    assert result.head is not None, result.reason
    expected = expected_weights(base_weights(), range(4))
    # Spot-check the hand computation itself: b = [1, -1, 0.25] - mean(b deltas).
    assert torch.equal(expected["b"], torch.tensor([0.875, -1.4375, -0.4375]))
    assert_same_tensors(result.weights or {}, expected)
    blob = bytes(encode_state_dict(expected))
    assert result.weights_blob == blob

    head = result.head
    assert result.window == 1
    assert head.experiment_id == MANIFEST.id
    assert head.height == 1
    assert head.parent == GENESIS.id
    assert head.weights_blob == hashlib.sha256(blob).hexdigest()
    assert head.optimizer_blob is None
    assert result.optimizer_blob is None
    ids = sorted(s.update_id for s in cohort)
    assert head.accepted == tuple(ids)
    assert result.accepted == tuple(ids)
    assert result.rejected == ()
    assert head.quarantine == ()
    assert result.head_id == head.id
    assert result.reason.startswith("4 accepted, 0 rejected")
    mean = {name: base_weights()[name] - value for name, value in expected.items()}
    assert result.aggregate_blob == encode_aggregate(mean)
    assert head.aggregate_blob == hashlib.sha256(result.aggregate_blob).hexdigest()


def test_the_result_does_not_depend_on_cohort_order() -> None:
    cohort = [*honest_cohort(), submit(BAD, delta(4), lease_samples=24)]
    first = reduce(cohort)
    assert first.head is not None
    for seed in (0, 1, 2):
        shuffled = list(cohort)
        random.Random(seed).shuffle(shuffled)
        again = reduce(shuffled)
        assert again.head_id == first.head_id, f"seed {seed}"
        assert again.weights_blob == first.weights_blob
        assert again.accepted == first.accepted
        assert again.rejected == first.rejected
    assert reduce(list(reversed(cohort))).head_id == first.head_id


def test_a_cohort_read_from_a_blob_store_by_range_gives_the_same_head(tmp_path: Path) -> None:
    """Blobs in a store's files, read a window at a time, reduce like blobs in memory; a
    file whose size is not the update's is refused like bytes that do not match."""
    cohort = [*honest_cohort(), submit(BAD, delta(4), lease_samples=24)]
    in_memory = reduce(cohort)
    with BlobStore(tmp_path / "blobs") as store:
        stored = []
        for submission in cohort:
            store.put(submission.blob)  # type: ignore[arg-type]
            reader = store.reader(submission.update.delta_blob)
            stored.append(Submission(submission.update, submission.update_id, reader))
        from_files = reduce(stored)
        other = store.reader(store.put(encode(delta(7))))
        wrong = submit(HONEST[0], delta(0))
        mismatch = reduce([Submission(wrong.update, wrong.update_id, other)])
    assert from_files.head_id == in_memory.head_id is not None
    assert from_files.rejected == in_memory.rejected
    assert [r.reason.code for r in mismatch.rejected] == [Code.BLOB_MISMATCH]


def test_two_reductions_give_byte_identical_blobs() -> None:
    one = reduce(honest_cohort())
    two = reduce(honest_cohort())
    assert one.weights_blob is not None
    assert one.weights_blob == two.weights_blob
    assert one.aggregate_blob == two.aggregate_blob
    assert one.head_id == two.head_id


def test_a_different_update_gives_a_different_head() -> None:
    cohort = honest_cohort()
    other = [*cohort[:3], submit(HONEST[3], delta(5))]
    assert reduce(other).head_id != reduce(cohort).head_id


def test_nesterov_stores_its_momentum_blob_in_the_head() -> None:
    manifest = msgspec.structs.replace(
        MANIFEST, protocol="diloco", outer_optimizer=OuterOptimizerSpec()
    )
    base = BaseState(genesis_head(manifest), genesis_head(manifest).id, base_weights())
    cohort = [submit(t, delta(i), base=base, manifest=manifest) for i, t in enumerate(HONEST)]
    result = reduce(cohort, base=base, manifest=manifest)
    assert result.head is not None, result.reason
    assert result.optimizer_blob is not None
    assert result.head.optimizer_blob == sha256_hex(result.optimizer_blob)
    assert result.optimizer_state is not None
    assert set(result.optimizer_state) == {"momentum.w", "momentum.b"}


# -------------------------------------------------------------------------- rejections

Case = Callable[[], list[Submission]]


def wrong_lease_samples() -> list[Submission]:
    return [submit(BAD, delta(4), lease_samples=24)]


def another_trainers_lease() -> list[Submission]:
    mine = lease_for(MANIFEST, 1, BAD.peer_id).shards
    theirs = next(
        lease.shards
        for lease in (lease_for(MANIFEST, 1, t.peer_id) for t in TRAINERS)
        if lease.shards != mine
    )
    return [submit(BAD, delta(4), lease_shards=theirs)]


def blob_not_matching_its_hash() -> list[Submission]:
    return [submit(BAD, delta(4), sent_blob=encode(delta(5)))]


def truncated_blob() -> list[Submission]:
    blob = encode(delta(4))
    return [submit(BAD, delta(4), sent_blob=blob[:-4])]


def garbage_blob() -> list[Submission]:
    return [submit(BAD, delta(4), blob=b"\x00" * 64)]


def blob_in_another_codec() -> list[Submission]:
    """A valid fp16 blob, named by an update that says fp32: it cannot decode as fp32."""
    return [submit(BAD, delta(4), blob=encode(delta(4), codec="fp16"))]


def update_claiming_another_codec() -> list[Submission]:
    return [submit(BAD, delta(4), blob=encode(delta(4), codec="fp16"), codec="fp16")]


def scaled_a_hundredfold() -> list[Submission]:
    return [submit(BAD, delta(4, scale=100.0))]


def opposite_direction() -> list[Submission]:
    return [submit(BAD, delta(4, scale=-1.0))]


REJECTIONS: dict[str, tuple[Case, str]] = {
    "wrong lease samples": (wrong_lease_samples, r"lease claims 24 samples, the lease holds 25"),
    "another trainer's lease": (another_trainers_lease, r"^lease names other shards"),
    "blob not matching its hash": (blob_not_matching_its_hash, r"^blob does not match"),
    "truncated blob": (truncated_blob, r"^blob does not match"),
    "garbage blob": (garbage_blob, r"^undecodable update: "),
    "blob in another codec": (blob_in_another_codec, r"^undecodable update: .*codec"),
    "update claiming another codec": (update_claiming_another_codec, r"^codec 'fp16'"),
    "scaled a hundredfold": (scaled_a_hundredfold, r"^norm .* exceeds 3.0x"),
    "opposite direction": (opposite_direction, r"^cosine .* below 0.0"),
}


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_a_bad_update_is_rejected_with_a_reason_and_a_strike(case: str) -> None:
    build, reason = REJECTIONS[case]
    honest = honest_cohort()
    bad = build()
    result = reduce(honest + bad)
    reasons = rejection_reasons(result)
    for submission in bad:
        assert submission.update_id in reasons, result
        assert submission.update_id not in result.accepted
        assert re.search(reason, reasons[submission.update_id]), reasons[submission.update_id]
    assert result.accepted == tuple(sorted(s.update_id for s in honest))
    assert result.head is not None, result.reason
    assert result.head.accepted == result.accepted
    assert_same_tensors(result.weights or {}, expected_weights(base_weights(), range(4)))
    assert standing(result.head, BAD) == QuarantineEntry(
        peer_id=BAD.peer_id,
        until_window=0,
        reason=next(r.reason for r in result.rejected if r.update_id == bad[0].update_id),
        strikes=1,
    )
    for trainer in HONEST:
        assert standing(result.head, trainer) is None


def test_every_update_of_a_trainer_that_sent_two_is_rejected() -> None:
    honest = honest_cohort()
    twice = [submit(BAD, delta(4)), submit(BAD, delta(5))]
    assert twice[0].update_id != twice[1].update_id
    result = reduce(honest + twice)
    reasons = rejection_reasons(result)
    for submission in twice:
        assert reasons[submission.update_id] == "trainer sent more than one update in this window"
        assert submission.update_id not in result.accepted
    assert result.accepted == tuple(sorted(s.update_id for s in honest))
    assert result.head is not None
    entry = standing(result.head, BAD)
    assert entry is not None
    assert entry.strikes == 1


def test_a_quarantined_trainer_is_rejected_without_a_strike() -> None:
    """On a head at height 3 that excludes BAD through window 6 and holds a strike for an
    honest trainer: BAD's update is rejected and its standing carries over unchanged; the
    honest trainer's accepted update clears its strike."""
    excluded = QuarantineEntry(
        peer_id=BAD.peer_id, until_window=6, reason=Reason(Code.UNDECODABLE), offences=1
    )
    reason = Reason(Code.BLOB_MISMATCH)
    struck = QuarantineEntry(peer_id=HONEST[0].peer_id, until_window=0, reason=reason, strikes=2)
    quarantine = tuple(sorted([excluded, struck], key=lambda e: e.peer_id))
    head = Head(
        experiment_id=MANIFEST.id,
        height=3,
        parent=h("height-2"),
        weights_blob=sha256_hex(bytes(encode_state_dict(base_weights()))),
        optimizer_blob=None,
        accepted=(h("some-update"),),
        quarantine=quarantine,
        aggregate_blob=h("aggregate-3"),
    )
    base = BaseState(head, head.id, base_weights())
    assert base.window == 4
    honest = honest_cohort(base)
    barred = submit(BAD, delta(4), base=base)
    result = reduce([*honest, barred], base=base)
    assert rejection_reasons(result) == {barred.update_id: "trainer is quarantined until window 6"}
    assert result.head is not None
    assert result.head.height == 4
    assert result.head.parent == head.id
    assert result.accepted == tuple(sorted(s.update_id for s in honest))
    assert result.head.quarantine == (excluded,)


def test_a_quarantine_ends_after_its_last_window() -> None:
    excluded = QuarantineEntry(
        peer_id=BAD.peer_id, until_window=3, reason=Reason(Code.UNDECODABLE), offences=1
    )
    head = Head(
        experiment_id=MANIFEST.id,
        height=3,
        parent=h("height-2"),
        weights_blob=h("weights-3"),
        optimizer_blob=None,
        quarantine=(excluded,),
        aggregate_blob=h("aggregate-3"),
    )
    base = BaseState(head, head.id, base_weights())
    back = submit(BAD, delta(4), base=base)
    result = reduce([*honest_cohort(base), back], base=base)
    assert back.update_id in result.accepted
    assert result.rejected == ()


def test_too_few_updates_give_no_head_with_the_reason() -> None:
    manifest = msgspec.structs.replace(MANIFEST, window=WindowSpec(min_updates=3))
    base = BaseState(genesis_head(manifest), genesis_head(manifest).id, base_weights())
    cohort = [submit(t, delta(i), base=base, manifest=manifest) for i, t in enumerate(HONEST[:2])]
    cohort.append(submit(BAD, delta(4), base=base, manifest=manifest, lease_samples=1))
    result = reduce(cohort, base=base, manifest=manifest)
    assert result.head is None
    assert result.head_id is None
    assert result.weights is None
    assert result.weights_blob is None
    assert result.reason == "2 updates passed screening, the window needs 3"
    assert result.accepted == tuple(sorted(s.update_id for s in cohort[:2]))
    assert set(rejection_reasons(result)) == {cohort[2].update_id}


def test_an_empty_cohort_gives_no_head() -> None:
    result = reduce([])
    assert result.head is None
    assert result.reason == "0 updates passed screening, the window needs 1"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"window": 2}, "window 2, this is 1"),
        ({"base_head": h("another head")}, "builds on head"),
        ({"experiment_id": h("another experiment")}, "another experiment"),
    ],
)
def test_an_update_for_another_window_is_a_local_error(
    change: dict[str, Any], message: str
) -> None:
    stray = submit(BAD, delta(4), **change)
    with pytest.raises(LocalError, match=message):
        reduce([*honest_cohort(), stray])


def test_a_cohort_larger_than_max_updates_is_a_local_error() -> None:
    manifest = msgspec.structs.replace(MANIFEST, window=WindowSpec(max_updates=3))
    base = BaseState(genesis_head(manifest), genesis_head(manifest).id, base_weights())
    cohort = [submit(t, delta(i), base=base, manifest=manifest) for i, t in enumerate(HONEST)]
    with pytest.raises(LocalError, match="max_updates"):
        reduce(cohort, base=base, manifest=manifest)


def test_the_same_update_listed_twice_does_not_penalise_its_trainer() -> None:
    cohort = honest_cohort()
    once = reduce(cohort)
    try:
        twice = reduce([*cohort, cohort[0]])
    except LocalError:  # refusing the cohort, as for other caller mistakes, is fine too
        return
    assert twice.rejected == ()
    assert twice.head_id == once.head_id


def test_a_heads_blob_ids_are_their_sha256_however_many_are_large() -> None:
    large = [bytes([i]) * (1 << 24) for i in range(2)]
    small = b"aggregate"
    expected = [sha256_hex(blob) for blob in [*large, small]]
    assert blob_ids(*large, small) == expected
    assert blob_ids(large[0], None, small) == [expected[0], None, expected[2]]
    assert blob_ids(small, None) == [expected[2], None]


# ------------------------------------------------------------------------ spooled blobs


@pytest.mark.parametrize(
    ("optimizer", "precision"),
    [("sgd", "fp32"), ("nesterov", "fp32"), ("nesterov", "int8")],
)
def test_a_reduction_spooled_to_files_gives_the_same_bytes(
    tmp_path: Path, optimizer: str, precision: str
) -> None:
    """Spooled into a store's files, a reduction writes the bytes it builds in memory, under
    the same ids; the store adopts each file by renaming it; the next window reduces from
    the spooled state (tensors mapped from the files) to the same head as from memory."""
    manifest = msgspec.structs.replace(
        MANIFEST,
        protocol="fedavg" if optimizer == "sgd" else "diloco",
        outer_optimizer=(
            OuterOptimizerSpec(name="sgd", lr=1.0, momentum=0.0)
            if optimizer == "sgd"
            else OuterOptimizerSpec()
        ),
        aggregation=AggregationSpec(rule="mean", precision=precision),
    )
    base = BaseState(genesis_head(manifest), genesis_head(manifest).id, base_weights())
    cohort = [submit(t, delta(i), base=base, manifest=manifest) for i, t in enumerate(HONEST)]
    in_memory = reduce_window(manifest, base, cohort, LeaseBook(manifest))
    with BlobStore(tmp_path / "blobs") as store:
        spool = FileSpool(store.spool_directory)
        spooled = reduce_window(manifest, base, cohort, LeaseBook(manifest), spool=spool)
        assert spooled.head_id == in_memory.head_id is not None
        assert spooled.head is not None
        pairs = [
            (spooled.weights_blob, in_memory.weights_blob, spooled.head.weights_blob),
            (spooled.aggregate_blob, in_memory.aggregate_blob, spooled.head.aggregate_blob),
            (spooled.optimizer_blob, in_memory.optimizer_blob, spooled.head.optimizer_blob),
        ]
        for file, memory, blob_id in pairs:
            if memory is None:
                assert file is None and blob_id is None
                continue
            assert isinstance(file, SpooledBlob) and isinstance(memory, bytearray)
            assert file.read(0, len(file)) == memory
            assert file.blob_id == blob_id == sha256_hex(memory)
            assert store.adopt(file) == blob_id
            assert store.get(blob_id) == memory
            assert file.read(0, len(file)) == memory  # still readable where it went
        assert spooled.weights is not None and in_memory.weights is not None
        assert_same_tensors(spooled.weights, dict(in_memory.weights))
        after = BaseState(spooled.head, spooled.head_id, spooled.weights, spooled.optimizer_state)
        memory_after = BaseState(
            spooled.head, spooled.head_id, in_memory.weights, in_memory.optimizer_state
        )
        second = [
            submit(t, delta(i + 1), base=after, manifest=manifest) for i, t in enumerate(HONEST)
        ]
        again = reduce_window(manifest, after, second, LeaseBook(manifest), spool=spool)
        expected = reduce_window(manifest, memory_after, second, LeaseBook(manifest))
        assert again.head_id == expected.head_id is not None
        kept = [blob_id for _, _, blob_id in pairs if blob_id is not None]
        del spooled, pairs, file, again, after
        gc.collect()
        # what the store adopted stays; what it did not is gone with its last user
        assert list(store.spool_directory.iterdir()) == []
        assert all(store.has(blob_id) for blob_id in kept)


# --------------------------------------------------------------- a sparse codec's warm-up


def test_the_dense_warm_up_window_takes_int4_updates_and_refuses_sparse_ones() -> None:
    """Window 1 of a ``sparseloco`` experiment with ``dense_windows = 1`` is a warm-up
    window: its updates are int4 blobs named ``int4``, and its aggregate is stored at int4
    whatever ``aggregation.precision`` says; a sparse update there is refused for its
    codec, counted against its trainer."""
    sparse = CodecSpec(name="sparseloco", config={"dense_windows": 1})
    manifest = msgspec.structs.replace(
        MANIFEST,
        codec=sparse,
        aggregation=AggregationSpec(rule="contributor_mean", precision="bf16"),
    )
    base = BaseState(genesis_head(manifest), genesis_head(manifest).id, base_weights())
    warm = [
        submit(
            t,
            delta(i),
            base=base,
            manifest=manifest,
            blob=make_encoder(CodecSpec(name="int4"), SCHEMA).encode(delta(i)),
            codec="int4",
        )
        for i, t in enumerate(HONEST)
    ]
    too_early = submit(
        BAD,
        delta(4),
        base=base,
        manifest=manifest,
        blob=make_encoder(sparse, SCHEMA).encode(delta(4)),
        codec="sparseloco",
    )
    result = reduce([*warm, too_early], base, manifest)
    assert result.head is not None, result.reason
    assert result.accepted == tuple(sorted(s.update_id for s in warm))
    assert rejection_reasons(result) == {
        too_early.update_id: "codec 'sparseloco', the experiment uses 'int4' in this window"
    }
    assert result.aggregate_blob is not None
    blob = bytes(result.aggregate_blob)
    decode_aggregate(blob, SCHEMA, max_bytes=len(blob), precision="int4")
    with pytest.raises(ProtocolViolation):
        decode_aggregate(blob, SCHEMA, max_bytes=len(blob), precision="bf16")


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_a_cohort_decoded_once_reduces_like_one_streamed_every_pass(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cohort small enough is decoded once and its later passes copy the values; with
    the budget at 0 every pass decodes the blobs again. Both give the same head, the same
    rejections and the same bytes."""
    build, _ = REJECTIONS[case]
    cohort = [*honest_cohort(), *build()]
    kept = reduce(cohort)
    monkeypatch.setattr(reduction, "KEEP_DECODED_BYTES", 0)
    streamed = reduce(cohort)
    assert kept.head_id == streamed.head_id is not None
    assert kept.rejected == streamed.rejected
    assert kept.weights_blob == streamed.weights_blob
    assert kept.aggregate_blob == streamed.aggregate_blob
