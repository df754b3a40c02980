"""The blob collector (node/collector.py) on a real blob store: what a pass deletes and keeps,
abandoned partial downloads, the count it keeps, and passes that fail."""

from __future__ import annotations

import asyncio
import fcntl
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from p2ptrain.core.records import Head, Update
from p2ptrain.net.partial_file import PARTIAL_DIR
from p2ptrain.node.collector import BlobCollector
from p2ptrain.protocol import retention as rule
from p2ptrain.protocol.retention import KeepSet, head_blob_ids
from p2ptrain.store.blobs import BlobStore
from tests.support.builders import h, identity

SEED = 20250301
EXPERIMENT = h("experiment")
GRACE_S = 10.0
#: A file written this long ago is older than the grace, not yet abandoned.
AN_HOUR_AGO = -3600.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BlobStore]:
    with BlobStore(tmp_path / "blobs") as opened:
        yield opened


class Fixture:
    """A store holding genesis, a shard, heads 1..5 (weights and optimizer state), updates
    of windows 2..6, and two blobs nobody named (one an hour old, one just written)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store
        self.rng = random.Random(SEED)
        self.now = time.time()
        self.genesis = self.put(age_s=AN_HOUR_AGO)
        self.shard = self.put(age_s=AN_HOUR_AGO)
        self.heads: dict[int, Head] = {0: self.head(0, self.genesis, None)}
        for height in range(1, 6):
            self.add_head(height)
        self.updates = {window: self.update(window, self.put()) for window in range(2, 7)}
        self.stale = self.put(age_s=AN_HOUR_AGO)
        self.young = self.put()

    def put(self, age_s: float = 0.0) -> str:
        blob = self.store.put(self.rng.randbytes(self.rng.randrange(100, 2000)))
        if age_s:
            os.utime(self.store.path(blob), (self.now + age_s, self.now + age_s))
        return blob

    def head(
        self, height: int, weights: str, optimizer: str | None, aggregate: str | None = None
    ) -> Head:
        return Head(
            experiment_id=EXPERIMENT,
            height=height,
            parent=None if height == 0 else h(f"parent-{height}"),
            weights_blob=weights,
            optimizer_blob=optimizer,
            aggregate_blob=aggregate,
        )

    def add_head(self, height: int) -> Head:
        self.heads[height] = self.head(height, self.put(), self.put(), self.put())
        return self.heads[height]

    def update(self, window: int, blob: str) -> Update:
        return Update(
            experiment_id=EXPERIMENT,
            window=window,
            base_head=h(f"base-{window}"),
            trainer=identity(window).public_key,
            lease_shards=("shard-0",),
            lease_samples=8,
            delta_blob=blob,
            delta_bytes=1,
            codec="int8",
            loss_before=2.0,
            loss_after=1.5,
        )

    def head_at(self, height: int) -> Head | None:
        return self.heads.get(height)

    def collector(self, keep_heads: int = 2) -> BlobCollector:
        collector = BlobCollector(
            self.store,
            keep_heads=keep_heads,
            pinned={self.genesis, self.shard},
            grace_s=GRACE_S,
            clock=lambda: self.now,
        )
        for update in self.updates.values():
            collector.saw_update(update)
        return collector

    def blobs_of(self, *heights: int) -> set[str]:
        return {b for n in heights for b in head_blob_ids(self.heads[n])}

    def deltas(self, *windows: int) -> set[str]:
        return {self.updates[w].delta_blob for w in windows}


def test_a_pass_keeps_the_last_heads_recent_updates_and_what_is_pinned(store: BlobStore) -> None:
    f = Fixture(store)
    before = store.usage()
    collector = f.collector(keep_heads=2)
    keep = collector.snapshot(5, f.head_at, in_use=[f.heads[5]])
    done = collector.collect(keep)

    kept = {f.genesis, f.shard, f.young} | f.blobs_of(4, 5) | f.deltas(4, 5, 6)
    assert set(store.ids()) == kept, f"seed={SEED}"
    assert done.reasons == {rule.OLD_HEAD: 9, rule.OLD_UPDATE: 2, rule.STALE: 1}
    assert done.blobs == 12
    assert store.usage().blobs == len(kept)
    assert store.usage().bytes == sum(store.size(b) for b in kept)
    assert done.bytes == before.bytes - store.usage().bytes
    stats = collector.statistics()
    assert (stats.passes, stats.blobs_collected, stats.bytes_collected) == (1, 12, done.bytes)
    assert (stats.height, stats.failures) == (5, 0)


def test_the_next_pass_releases_only_what_fell_out_since(store: BlobStore) -> None:
    f = Fixture(store)
    collector = f.collector(keep_heads=2)
    collector.collect(collector.snapshot(5, f.head_at, in_use=[f.heads[5]]))
    # head 6 names head 4's optimizer state again: a blob named by a head that falls out
    # and by one kept stays
    six = f.heads[6] = f.head(6, f.put(), f.heads[4].optimizer_blob, f.put())
    collector.saw_update(f.update(7, f.put()))
    done = collector.collect(collector.snapshot(6, f.head_at, in_use=[six]))
    assert done.reasons == {rule.OLD_HEAD: 2, rule.OLD_UPDATE: 1}  # weights and aggregate
    assert not store.has(f.heads[4].weights_blob) and store.has(f.heads[4].optimizer_blob)
    assert f.blobs_of(5) <= set(store.ids()) and store.has(six.weights_blob)
    assert not store.has(f.updates[4].delta_blob) and store.has(f.updates[5].delta_blob)


def test_the_heads_roles_build_on_stay_even_with_one_head_kept(store: BlobStore) -> None:
    f = Fixture(store)
    collector = f.collector(keep_heads=1)
    # head 5 is certified, its weights are still being fetched: the roles build on head 4
    collector.collect(collector.snapshot(5, f.head_at, in_use=[f.heads[4]]))
    assert f.blobs_of(4, 5) <= set(store.ids())
    assert not f.blobs_of(3) & set(store.ids())


def write_partial(directory: Path, blob_id: str, now: float, age_s: float) -> None:
    directory.mkdir(exist_ok=True)
    for name in (blob_id, f"{blob_id}.json"):
        (directory / name).write_bytes(b"\0" * 64)
        os.utime(directory / name, (now + age_s, now + age_s))


def test_abandoned_partial_downloads_are_removed(store: BlobStore) -> None:
    f = Fixture(store)
    directory = store.root / PARTIAL_DIR
    wanted = h("an update of the open window")
    unknown, fetching, young = h("unknown"), h("being fetched"), h("just begun")
    for blob_id in (wanted, unknown, fetching, f.genesis):
        write_partial(directory, blob_id, f.now, AN_HOUR_AGO / 2)
    write_partial(directory, young, f.now, 0.0)
    (directory / "notes.txt").write_bytes(b"not a download")
    collector = f.collector()
    collector.saw_update(f.update(6, wanted))
    with open(directory / fetching, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the fetcher holds it
        done = collector.collect(collector.snapshot(5, f.head_at, in_use=[f.heads[5]]))
    left = sorted(os.listdir(directory))
    assert left == sorted(
        [
            *(n for b in (wanted, fetching, young) for n in (b, f"{b}.json")),
            "notes.txt",
        ]
    )
    assert done.partials == 2 and done.partial_bytes == 2 * 2 * 64
    assert done.reasons[rule.UNWANTED] == 1 and done.reasons[rule.DOWNLOADED] == 1
    # the fetch gave up: the next pass removes it (no longer being downloaded, not wanted)
    collector.collect(collector.snapshot(5, f.head_at, in_use=[f.heads[5]]))
    assert not (directory / fetching).exists() and (directory / wanted).exists()
    assert collector.statistics().partials_removed == 3


def test_a_failed_pass_is_counted_and_the_next_one_runs(
    store: BlobStore, caplog: pytest.LogCaptureFixture
) -> None:
    f = Fixture(store)
    collector = f.collector()
    snapshots = 0

    def snapshot() -> KeepSet:
        nonlocal snapshots
        snapshots += 1
        if snapshots == 1:
            raise RuntimeError("the chain is in a bad mood")
        return collector.snapshot(5, f.head_at, in_use=[f.heads[5]])

    async def scenario() -> None:
        running = asyncio.create_task(collector.run(snapshot))
        collector.request()
        await until(lambda: collector.statistics().failures == 1)
        assert running.done() is False  # a failure never ends it
        collector.request()
        await until(lambda: collector.statistics().passes == 1)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    async def until(condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(10.0):
            while not condition():
                await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert "the chain is in a bad mood" in caplog.text
    assert not store.has(f.stale)
