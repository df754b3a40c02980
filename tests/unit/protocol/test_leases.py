"""Leases: computed from (experiment, window, shard, trainer), checkable by anyone."""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.core.manifests import DatasetManifest, ExperimentManifest, ShardInfo
from p2ptrain.core.reasons import Code, Reason, describe
from p2ptrain.core.records import Update
from p2ptrain.data.shards import lease_indices
from p2ptrain.errors import InvalidRecord, LocalError
from p2ptrain.protocol import leases as leases_module
from p2ptrain.protocol.leases import Lease, LeaseBook, check_lease, lease_for, lease_start
from tests.support.builders import experiment, h, identity

VALIDATORS = [identity(i) for i in range(3)]
TRAINERS = [identity(100 + i) for i in range(200)]


def manifest_with(sizes: list[int], lease_size: int) -> ExperimentManifest:
    """The builders' manifest over shards ``shard-00``, ``shard-01``, ... of these sizes."""
    shards = tuple(
        ShardInfo(name=f"shard-{i:02d}", blob_id=h(f"shard-{i}"), samples=size)
        for i, size in enumerate(sizes)
    )
    return msgspec.structs.replace(
        experiment(VALIDATORS, quorum=2),
        dataset=DatasetManifest(name="digits", shards=shards),
        lease_size=lease_size,
    )


UNEVEN = manifest_with([7, 13, 5, 20, 11, 9, 30, 4], lease_size=25)
EVEN = manifest_with([10] * 10, lease_size=30)


def update_claiming(manifest: ExperimentManifest, lease: Lease, **changes: object) -> Update:
    """An update for ``lease``'s trainer and window, claiming ``lease`` unless ``changes``
    say otherwise."""
    trainer = next(t for t in TRAINERS if t.peer_id == lease.peer_id)
    fields: dict[str, object] = {
        "experiment_id": manifest.id,
        "window": lease.window,
        "base_head": h("base"),
        "trainer": trainer.public_key,
        "lease_shards": lease.shards,
        "lease_samples": lease.samples,
        "delta_blob": h("delta"),
        "delta_bytes": 100,
        "codec": "int8",
        "loss_before": 1.0,
        "loss_after": 0.5,
    }
    fields.update(changes)
    return Update(**fields)  # type: ignore[arg-type]


def documented_hash(domain: bytes, manifest: ExperimentManifest, w: int, s: str, p: str) -> bytes:
    """SHA-256(domain 0 experiment 0 window 0 shard 0 peer), as docs/protocol.md writes it."""
    parts = [domain, manifest.id.encode(), str(w).encode(), s.encode(), p.encode()]
    return hashlib.sha256(b"\0".join(parts)).digest()


def documented_lease(manifest: ExperimentManifest, window: int, peer: str) -> Lease:
    """The lease rule of docs/protocol.md, written out again without lease_for's shortcuts."""
    ranked = sorted(
        manifest.dataset.shards,
        key=lambda s: documented_hash(b"p2ptrain/v2/lease", manifest, window, s.name, peer),
    )
    parts, needed = [], manifest.lease_size
    for shard in ranked:
        if needed == 0:
            break
        count = min(needed, shard.samples)
        digest = documented_hash(b"p2ptrain/v2/lease-start", manifest, window, shard.name, peer)
        start = 0 if count == shard.samples else int(digest.hex(), 16) % shard.samples
        parts.append((shard.name, start, count))
        needed -= count
    return Lease(window=window, peer_id=peer, parts=tuple(parts))


def test_the_score_is_the_documented_rendezvous_hash() -> None:
    """The shards are taken in ascending SHA-256("p2ptrain/v2/lease" 0 exp 0 w 0 s 0 p)."""
    peer = TRAINERS[0].peer_id
    lease = lease_for(UNEVEN, 7, peer)

    def score(shard: str) -> bytes:
        parts = [b"p2ptrain/v2/lease", UNEVEN.id.encode(), b"7", shard.encode(), peer.encode()]
        return hashlib.sha256(b"\0".join(parts)).digest()

    ranked = sorted((s.name for s in UNEVEN.dataset.shards), key=score)
    assert [name for name, _, _ in lease.parts] == ranked[: len(lease.parts)]


def test_the_start_of_a_partial_part_is_the_documented_hash() -> None:
    """A part taking some of a shard starts at SHA-256("p2ptrain/v2/lease-start" 0 exp 0 w 0
    s 0 p), read big-endian, mod the shard's samples; a whole shard starts at 0."""
    sizes = {s.name: s.samples for s in UNEVEN.dataset.shards}
    for trainer in TRAINERS[:20]:
        peer = trainer.peer_id
        lease = lease_for(UNEVEN, 7, peer)
        *whole, (name, start, count) = lease.parts
        assert all(start == 0 for _, start, _ in whole)
        digest = hashlib.sha256(
            b"\0".join([b"p2ptrain/v2/lease-start", UNEVEN.id.encode(), b"7", name.encode(),
                        peer.encode()])
        ).digest()  # fmt: skip
        if count < sizes[name]:
            assert start == int.from_bytes(digest, "big") % sizes[name]
            assert start == lease_start(UNEVEN.id, 7, name, peer, sizes[name])
        else:
            assert start == 0


@pytest.mark.parametrize("manifest", [UNEVEN, EVEN], ids=["uneven", "even"])
def test_lease_for_equals_the_rule_written_out_again(manifest: ExperimentManifest) -> None:
    for window, trainer in itertools.product((1, 2, 99), TRAINERS[:30]):
        assert lease_for(manifest, window, trainer.peer_id) == documented_lease(
            manifest, window, trainer.peer_id
        )


@pytest.mark.parametrize("window", [1, 2, 3, 50])
def test_a_lease_holds_exactly_lease_size_samples_in_whole_shards_but_the_last(
    window: int,
) -> None:
    sizes = {s.name: s.samples for s in UNEVEN.dataset.shards}
    for trainer in TRAINERS[:50]:
        lease = lease_for(UNEVEN, window, trainer.peer_id)
        assert lease.window == window
        assert lease.peer_id == trainer.peer_id
        assert lease.samples == UNEVEN.lease_size == 25
        *whole, (last_name, last_start, last_count) = lease.parts
        for name, start, count in whole:
            assert count == sizes[name], f"{name} taken partially but is not the last shard"
            assert start == 0
        assert 0 < last_count <= sizes[last_name]
        assert 0 <= last_start < sizes[last_name]
        names = [name for name, _, _ in lease.parts]
        assert len(set(names)) == len(names)
        assert lease.shards == tuple(sorted(names))


def test_a_lease_covering_the_whole_dataset_takes_every_sample() -> None:
    everything = manifest_with([7, 13, 5], lease_size=25)
    lease = lease_for(everything, 3, TRAINERS[0].peer_id)
    assert lease.samples == 25
    assert sorted(lease.parts) == [("shard-00", 0, 7), ("shard-01", 0, 13), ("shard-02", 0, 5)]


def test_a_lease_larger_than_the_dataset_is_refused_by_the_manifest() -> None:
    with pytest.raises(InvalidRecord, match="lease_size"):
        manifest_with([7, 13, 5], lease_size=26)


def test_a_lease_within_one_shard_takes_consecutive_samples_from_anywhere() -> None:
    small = manifest_with([50, 50], lease_size=3)
    starts = set()
    for trainer in TRAINERS:
        lease = lease_for(small, 1, trainer.peer_id)
        assert len(lease.parts) == 1
        _, start, count = lease.parts[0]
        assert count == 3
        starts.add(start)
    # 200 starts drawn from 50: all but ~0.9 of them expected to appear.
    assert len(starts) >= 45
    assert max(starts) >= 48, "starts near the end (the part wraps around) must occur"


def test_leases_are_deterministic() -> None:
    peer = TRAINERS[5].peer_id
    first = lease_for(UNEVEN, 9, peer)
    assert lease_for(UNEVEN, 9, peer) == first
    assert lease_for(UNEVEN, 9, peer, experiment_id=UNEVEN.id) == first


def test_leases_depend_on_the_experiment() -> None:
    other = msgspec.structs.replace(UNEVEN, name="other")
    peers = [t.peer_id for t in TRAINERS[:50]]
    differ = sum(lease_for(UNEVEN, 1, p).parts != lease_for(other, 1, p).parts for p in peers)
    assert differ >= 40


def test_leases_change_between_windows() -> None:
    peers = [t.peer_id for t in TRAINERS]
    differ = sum(lease_for(EVEN, 1, p).parts != lease_for(EVEN, 2, p).parts for p in peers)
    # Three of ten shards in order: the same lease again has probability 1/720.
    assert differ >= 190
    one_trainer = {lease_for(EVEN, w, peers[0]).shards for w in range(1, 21)}
    assert len(one_trainer) >= 10


def test_leases_differ_between_trainers() -> None:
    leases = {lease_for(EVEN, 4, t.peer_id).shards for t in TRAINERS}
    # 120 possible shard sets, 200 trainers: nearly all sets appear.
    assert len(leases) >= 60


def test_every_shard_is_taken_by_about_its_share_of_trainers() -> None:
    """200 trainers taking 3 of 10 equal shards: each shard in ~60 leases (sd ~6.5) and
    first in ~20 rankings (sd ~4.2); the bounds are beyond 4 sd."""
    for window in (1, 2):
        taken: Counter[str] = Counter()
        first: Counter[str] = Counter()
        for trainer in TRAINERS:
            lease = lease_for(EVEN, window, trainer.peer_id)
            taken.update(lease.shards)
            first[lease.parts[0][0]] += 1
        assert set(taken) == {s.name for s in EVEN.dataset.shards}
        assert sum(taken.values()) == 600
        assert all(30 <= count <= 90 for count in taken.values()), taken
        assert sum(first.values()) == 200
        assert all(3 <= first[s.name] <= 40 for s in EVEN.dataset.shards), first


def test_check_lease_accepts_the_true_lease() -> None:
    lease = lease_for(UNEVEN, 3, TRAINERS[1].peer_id)
    update = update_claiming(UNEVEN, lease, window=3)
    assert check_lease(UNEVEN, update) is None
    assert check_lease(UNEVEN, update, lease) is None


def test_check_lease_rejects_cherry_picked_shards() -> None:
    lease = lease_for(UNEVEN, 3, TRAINERS[1].peer_id)
    others = tuple(sorted(s.name for s in UNEVEN.dataset.shards if s.name not in lease.shards))
    picked = (*lease.shards[1:], others[0])
    update = update_claiming(UNEVEN, lease, lease_shards=tuple(sorted(picked)))
    assert check_lease(UNEVEN, update) == Reason(Code.LEASE_SHARDS, (3,))


def test_check_lease_rejects_another_trainers_lease() -> None:
    mine = lease_for(EVEN, 3, TRAINERS[1].peer_id)
    theirs = next(
        lease
        for lease in (lease_for(EVEN, 3, t.peer_id) for t in TRAINERS[2:])
        if lease.shards != mine.shards
    )
    update = update_claiming(EVEN, mine, lease_shards=theirs.shards)
    assert check_lease(EVEN, update) == Reason(Code.LEASE_SHARDS, (3,))


def test_check_lease_rejects_the_same_shards_with_another_sample_count() -> None:
    lease = lease_for(UNEVEN, 3, TRAINERS[1].peer_id)
    for samples in (lease.samples - 1, lease.samples + 1, lease.samples * 10):
        verdict = check_lease(UNEVEN, update_claiming(UNEVEN, lease, lease_samples=samples))
        assert verdict == Reason(Code.LEASE_SAMPLES, (samples, 25))
        assert describe(verdict) == f"lease claims {samples} samples, the lease holds 25"


def test_check_lease_rejects_a_lease_from_another_window() -> None:
    peer = TRAINERS[1].peer_id
    earlier = lease_for(EVEN, 2, peer)
    assert earlier.shards != lease_for(EVEN, 3, peer).shards
    verdict = check_lease(EVEN, update_claiming(EVEN, earlier, window=3))
    assert verdict == Reason(Code.LEASE_SHARDS, (3,))
    assert "window 3" in describe(verdict)


def test_the_lease_book_gives_the_same_leases_as_lease_for() -> None:
    book = LeaseBook(UNEVEN)
    assert book.experiment_id == UNEVEN.id
    for window in (1, 2, 3):
        for trainer in TRAINERS[:20]:
            assert book.lease(window, trainer.peer_id) == lease_for(UNEVEN, window, trainer.peer_id)
    lease = lease_for(UNEVEN, 2, TRAINERS[3].peer_id)
    good = update_claiming(UNEVEN, lease)
    bad = update_claiming(UNEVEN, lease, lease_samples=24)
    assert book.check(good) == check_lease(UNEVEN, good)
    assert book.check(bad) == check_lease(UNEVEN, bad)
    assert book.check(good) is None and book.check(bad) is not None


def test_the_lease_book_remembers_recent_windows_and_forgets_old_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, str]] = []
    real = leases_module.lease_for

    def counting(manifest: ExperimentManifest, window: int, peer_id: str, **kw: object) -> Lease:
        calls.append((window, peer_id))
        return real(manifest, window, peer_id, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(leases_module, "lease_for", counting)
    book = LeaseBook(UNEVEN, keep_windows=2)
    peer = TRAINERS[0].peer_id
    first = book.lease(1, peer)
    assert book.lease(1, peer) is first
    assert calls == [(1, peer)]
    book.lease(2, peer)
    assert book.lease(1, peer) is first  # two windows kept
    assert len(calls) == 2
    book.lease(3, peer)  # window 1 is now the oldest of three: forgotten
    assert len(calls) == 3
    again = book.lease(1, peer)
    assert len(calls) == 4, "window 1 should have been forgotten and recomputed"
    assert again == first
    book.lease(3, peer)
    assert len(calls) == 4, "window 3 is recent and should be remembered"


def test_every_sample_is_leased_by_someone() -> None:
    """Over 200 trainers and 20 windows, every sample of every shard is in some lease."""
    used = {s.name: [False] * s.samples for s in UNEVEN.dataset.shards}
    for window in range(1, 21):
        for trainer in TRAINERS:
            for name, start, count in lease_for(UNEVEN, window, trainer.peer_id).parts:
                flags = used[name]
                for i in range(start, start + count):
                    flags[i % len(flags)] = True
    unused = {name: flags.count(False) for name, flags in used.items() if not all(flags)}
    assert unused == {}


def test_partial_parts_start_uniformly() -> None:
    """A shard of 30 taken partly by 2000 (window, trainer) leases of 25: the starts of its
    parts fall in the shard's 30 positions about equally. Pearson's chi-square over 30
    cells (29 degrees of freedom) is below 58.3, its 0.1% tail, unless starts are skewed."""
    one_shard = manifest_with([30, 30], lease_size=25)
    starts: Counter[int] = Counter()
    for window in range(1, 11):
        for trainer in TRAINERS:
            ((_, start, count),) = lease_for(one_shard, window, trainer.peer_id).parts
            assert count == 25
            starts[start] += 1
    expected = 2000 / 30
    chi_square = sum((starts[i] - expected) ** 2 / expected for i in range(30))
    assert chi_square < 58.3, (chi_square, sorted(starts.items()))


@st.composite
def manifests(draw: st.DrawFn) -> ExperimentManifest:
    """Up to 6 shards of uneven sizes; a lease from one sample to the whole dataset, so it
    is smaller than some shards and larger than others."""
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    return manifest_with(sizes, lease_size=draw(st.integers(1, sum(sizes))))


@settings(max_examples=40)
@given(manifests(), st.integers(1, 10**6), st.integers(0, len(TRAINERS) - 1))
def test_leases_name_exactly_their_samples_and_reach_every_sample(
    manifest: ExperimentManifest, first_window: int, trainer: int
) -> None:
    """For any manifest: a lease is deterministic and holds lease_size samples; its indices
    are that many, distinct, each inside the shard its part names; and leases over enough
    windows reach every sample. A sample is in a lease with probability at least
    1/(6 * 40) = 1/240, so 20,000 leases miss one of 240 samples with probability < 1e-30."""
    dataset = manifest.dataset
    offsets = dict(
        zip((s.name for s in dataset.shards), itertools.accumulate(
            (s.samples for s in dataset.shards), initial=0), strict=False)
    )  # fmt: skip
    sizes = {s.name: s.samples for s in dataset.shards}
    unseen = set(range(dataset.total_samples))
    peers = itertools.cycle(t.peer_id for t in TRAINERS[trainer:] + TRAINERS[:trainer])
    for n in range(20_000):
        window, peer = first_window + n // len(TRAINERS), next(peers)
        lease = lease_for(manifest, window, peer)
        indices = lease_indices(dataset, lease)
        if n < 50:
            assert lease_for(manifest, window, peer) == lease
            assert lease.samples == manifest.lease_size == len(indices)
            assert len(set(indices)) == len(indices)
            position = 0
            for name, start, count in lease.parts:
                assert 0 <= start < sizes[name]
                expected = [offsets[name] + (start + i) % sizes[name] for i in range(count)]
                assert indices[position : position + count] == expected
                position += count
        unseen.difference_update(indices)
        if not unseen:
            return
    raise AssertionError(f"samples {sorted(unseen)[:10]} never leased in 20,000 leases")


def test_a_lease_book_keeping_no_windows_remembers_none(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = leases_module.lease_for

    def counting(manifest: ExperimentManifest, window: int, peer_id: str, **kw: object) -> Lease:
        calls.append(window)
        return real(manifest, window, peer_id, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(leases_module, "lease_for", counting)
    try:
        book = LeaseBook(UNEVEN, keep_windows=0)
    except (ValueError, LocalError):  # refusing the setting at construction is fine too
        return
    peer = TRAINERS[0].peer_id
    for window in range(1, 6):
        book.lease(window, peer)
    book.lease(1, peer)
    assert calls == [1, 2, 3, 4, 5, 1]  # today: [1, 2, 3, 4, 5], window 1 still held
