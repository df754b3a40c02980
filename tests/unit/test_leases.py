"""Leases: computed from (experiment, window, shard, trainer), checkable by anyone."""

from __future__ import annotations

import hashlib
from collections import Counter

import msgspec
import pytest

from p2ptrain.core.manifests import DatasetManifest, ExperimentManifest, ShardInfo
from p2ptrain.core.records import Update
from p2ptrain.errors import InvalidRecord, LocalError
from p2ptrain.protocol import leases as leases_module
from p2ptrain.protocol.leases import Lease, LeaseBook, check_lease, lease_for
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


def test_the_score_is_the_documented_rendezvous_hash() -> None:
    """The shards are taken in ascending SHA-256("p2ptrain/v1/lease" 0 exp 0 w 0 s 0 p)."""
    peer = TRAINERS[0].peer_id
    lease = lease_for(UNEVEN, 7, peer)

    def score(shard: str) -> bytes:
        parts = [b"p2ptrain/v1/lease", UNEVEN.id.encode(), b"7", shard.encode(), peer.encode()]
        return hashlib.sha256(b"\0".join(parts)).digest()

    ranked = sorted((s.name for s in UNEVEN.dataset.shards), key=score)
    assert [name for name, _ in lease.parts] == ranked[: len(lease.parts)]


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
        *whole, (last_name, last_count) = lease.parts
        for name, count in whole:
            assert count == sizes[name], f"{name} taken partially but is not the last shard"
        assert 0 < last_count <= sizes[last_name]
        names = [name for name, _ in lease.parts]
        assert len(set(names)) == len(names)
        assert lease.shards == tuple(sorted(names))


def test_a_lease_covering_the_whole_dataset_takes_every_sample() -> None:
    everything = manifest_with([7, 13, 5], lease_size=25)
    lease = lease_for(everything, 3, TRAINERS[0].peer_id)
    assert lease.samples == 25
    assert dict(lease.parts) == {"shard-00": 7, "shard-01": 13, "shard-02": 5}


def test_a_lease_larger_than_the_dataset_is_refused_by_the_manifest() -> None:
    with pytest.raises(InvalidRecord, match="lease_size"):
        manifest_with([7, 13, 5], lease_size=26)


def test_a_lease_within_one_shard_takes_its_first_samples() -> None:
    small = manifest_with([50, 50], lease_size=3)
    lease = lease_for(small, 1, TRAINERS[0].peer_id)
    assert len(lease.parts) == 1
    assert lease.parts[0][1] == 3


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
    verdict = check_lease(UNEVEN, update)
    assert verdict.ok, verdict.reason
    assert verdict.reason == "lease matches"
    assert check_lease(UNEVEN, update, lease)


def test_check_lease_rejects_cherry_picked_shards() -> None:
    lease = lease_for(UNEVEN, 3, TRAINERS[1].peer_id)
    others = tuple(sorted(s.name for s in UNEVEN.dataset.shards if s.name not in lease.shards))
    picked = (*lease.shards[1:], others[0])
    update = update_claiming(UNEVEN, lease, lease_shards=tuple(sorted(picked)))
    verdict = check_lease(UNEVEN, update)
    assert not verdict
    assert "lease names shards" in verdict.reason
    assert "window 3" in verdict.reason


def test_check_lease_rejects_another_trainers_lease() -> None:
    mine = lease_for(EVEN, 3, TRAINERS[1].peer_id)
    theirs = next(
        lease
        for lease in (lease_for(EVEN, 3, t.peer_id) for t in TRAINERS[2:])
        if lease.shards != mine.shards
    )
    update = update_claiming(EVEN, mine, lease_shards=theirs.shards)
    verdict = check_lease(EVEN, update)
    assert not verdict
    assert "lease names shards" in verdict.reason


def test_check_lease_rejects_the_same_shards_with_another_sample_count() -> None:
    lease = lease_for(UNEVEN, 3, TRAINERS[1].peer_id)
    for samples in (lease.samples - 1, lease.samples + 1, lease.samples * 10):
        verdict = check_lease(UNEVEN, update_claiming(UNEVEN, lease, lease_samples=samples))
        assert not verdict
        assert verdict.reason == f"lease claims {samples} samples, the lease holds 25"


def test_check_lease_rejects_a_lease_from_another_window() -> None:
    peer = TRAINERS[1].peer_id
    earlier = lease_for(EVEN, 2, peer)
    assert earlier.shards != lease_for(EVEN, 3, peer).shards
    verdict = check_lease(EVEN, update_claiming(EVEN, earlier, window=3))
    assert not verdict
    assert "window 3" in verdict.reason


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
    assert not book.check(bad)


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


@pytest.mark.xfail(
    strict=True,
    reason="leases.py lease_for takes the *first* samples of a partially taken shard, so "
    "samples past lease_size in a larger shard are never leased (and shard heads are "
    "oversampled); see the report",
)
def test_every_sample_is_leased_by_someone() -> None:
    """Over 200 trainers and 20 windows, every sample of every shard is in some lease."""
    used = {s.name: [False] * s.samples for s in UNEVEN.dataset.shards}
    for window in range(1, 21):
        for trainer in TRAINERS:
            for name, count in lease_for(UNEVEN, window, trainer.peer_id).parts:
                used[name][:count] = [True] * count
    unused = {name: flags.count(False) for name, flags in used.items() if not all(flags)}
    assert unused == {}  # today: {"shard-06": 5}, its samples 25..29


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
