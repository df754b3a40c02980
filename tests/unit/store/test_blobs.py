"""BlobStore: content addressing, durability protocol, verification on read, concurrency."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2ptrain.errors import BlobCorrupted, BlobNotFound, LocalError, ProtocolViolation
from p2ptrain.store import blobs
from p2ptrain.store.blobs import (
    BlobStore,
    BlobStoreStatistics,
    BlobUsage,
    blob_id,
    validate_blob_id,
)

SEED = 20240611
SMALL = b"hello, blob"
SMALL_ID = hashlib.sha256(SMALL).hexdigest()
# Above the size at which put() and get() switch to their two-thread paths.
LARGE_SIZE = 3 * (1 << 20) + 12345


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BlobStore]:
    with BlobStore(tmp_path / "blobs") as opened:
        yield opened


@pytest.fixture
def large() -> bytes:
    return random.Random(SEED).randbytes(LARGE_SIZE)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        (byte,) = file.read(1)
        file.seek(offset)
        file.write(bytes([byte ^ 0x01]))


# -- ids ----------------------------------------------------------------------------------


def test_blob_id_is_lowercase_hex_sha256() -> None:
    assert blob_id(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert blob_id(memoryview(b"abc")) == blob_id(b"abc")


@pytest.mark.parametrize(
    "bad",
    ["", "ab", SMALL_ID.upper(), SMALL_ID[:-1], SMALL_ID + "0", "g" * 64, "../" + "0" * 61, 7],
)
def test_malformed_ids_from_peers_are_protocol_violations(bad: object) -> None:
    with pytest.raises(ProtocolViolation, match="malformed blob id"):
        validate_blob_id(bad)


def test_validate_blob_id_returns_good_ids() -> None:
    assert validate_blob_id(SMALL_ID) == SMALL_ID


@pytest.mark.parametrize("bad", ["0" * 63, SMALL_ID.upper(), "../../etc/passwd"])
def test_store_methods_treat_malformed_ids_as_local_errors(store: BlobStore, bad: str) -> None:
    for call in (store.get, store.has, store.size, store.path, store.delete):
        with pytest.raises(LocalError, match="malformed blob id"):
            call(bad)
    with pytest.raises(LocalError, match="malformed blob id"):
        store.put_stream([SMALL], expected_id=bad)


# -- round trips --------------------------------------------------------------------------


def test_put_get_round_trip_small(store: BlobStore) -> None:
    assert store.put(SMALL) == SMALL_ID
    assert store.get(SMALL_ID) == SMALL
    assert store.has(SMALL_ID)
    assert store.size(SMALL_ID) == len(SMALL)
    assert store.path(SMALL_ID) == store.root / SMALL_ID[:2] / SMALL_ID


def test_put_get_round_trip_large(store: BlobStore, large: bytes) -> None:
    identifier = store.put(large)
    assert identifier == hashlib.sha256(large).hexdigest(), f"seed={SEED}"
    got = store.get(identifier)
    assert type(got) is bytearray
    assert got == large, f"seed={SEED}"


@pytest.mark.parametrize("size", [0, 1, 2, (1 << 20) - 1, 1 << 20, (8 << 20) + 1])
def test_round_trip_at_size_boundaries(store: BlobStore, size: int) -> None:
    data = random.Random(SEED + size).randbytes(size)
    assert store.get(store.put(data)) == data, f"seed={SEED + size}"


def test_put_accepts_bytearray_and_memoryview(store: BlobStore, large: bytes) -> None:
    assert store.put(bytearray(SMALL)) == SMALL_ID
    assert store.put(memoryview(large)[1:]) == blob_id(large[1:])


def test_put_twice_is_deduplicated(store: BlobStore, large: bytes) -> None:
    store.put(SMALL)
    store.put(SMALL)
    store.put(large)
    store.put(large)
    stats = store.statistics()
    assert (stats.blobs_put, stats.blobs_deduplicated) == (2, 2)
    assert stats.bytes_put == 2 * (len(SMALL) + len(large))
    assert list(store.ids()) == sorted([SMALL_ID, blob_id(large)])
    assert os.listdir(store.root / "tmp") == []


def test_put_refuses_blobs_over_the_limit(tmp_path: Path) -> None:
    with BlobStore(tmp_path, max_blob_bytes=4) as store:
        with pytest.raises(LocalError, match="exceeds max_blob_bytes=4"):
            store.put(b"12345")
        assert store.put(b"1234") == blob_id(b"1234")


# -- streams ------------------------------------------------------------------------------


def test_put_stream_from_chunks_and_from_file(store: BlobStore, large: bytes) -> None:
    chunks = [large[i : i + 99_999] for i in range(0, len(large), 99_999)]
    assert store.put_stream(iter(chunks)) == blob_id(large)
    store.delete(blob_id(large))
    assert store.put_stream(io.BytesIO(large), expected_id=blob_id(large)) == blob_id(large)
    assert store.get(blob_id(large)) == large


def test_put_stream_of_nothing_is_the_empty_blob(store: BlobStore) -> None:
    assert store.put_stream([]) == blob_id(b"")
    assert store.get(blob_id(b"")) == b""


def test_put_stream_with_wrong_expected_id_stores_nothing(store: BlobStore, large: bytes) -> None:
    wrong = blob_id(b"something else")
    with pytest.raises(ProtocolViolation, match=f"not to the expected id {wrong}"):
        store.put_stream(io.BytesIO(large), expected_id=wrong)
    assert list(store.ids()) == []
    assert not store.has(wrong)
    assert not store.has(blob_id(large))
    assert os.listdir(store.root / "tmp") == []
    assert store.statistics().streams_rejected == 1


def test_put_stream_over_max_bytes_stores_nothing(store: BlobStore) -> None:
    consumed: list[int] = []

    def endless() -> Iterator[bytes]:
        for index in range(1_000_000):
            consumed.append(index)
            yield b"x" * 1000

    with pytest.raises(ProtocolViolation, match="exceeds its limit of 5000 bytes"):
        store.put_stream(endless(), max_bytes=5000)
    assert len(consumed) == 6  # stopped at the first chunk over the limit
    assert list(store.ids()) == []
    assert os.listdir(store.root / "tmp") == []


def test_put_stream_exactly_max_bytes_is_accepted(store: BlobStore) -> None:
    assert store.put_stream([b"x" * 5000], max_bytes=5000) == blob_id(b"x" * 5000)


def test_put_stream_refuses_a_negative_limit(store: BlobStore) -> None:
    with pytest.raises(LocalError, match="max_bytes must not be negative"):
        store.put_stream([b"x"], max_bytes=-1)


def test_put_stream_respects_store_limit_too(tmp_path: Path) -> None:
    with (
        BlobStore(tmp_path, max_blob_bytes=10) as store,
        pytest.raises(ProtocolViolation, match="limit of 10 bytes"),
    ):
        store.put_stream([b"x" * 11], max_bytes=100)


def test_put_stream_error_in_source_stores_nothing(store: BlobStore) -> None:
    def failing() -> Iterator[bytes]:
        yield b"partial"
        raise OSError("connection reset")

    with pytest.raises(OSError, match="connection reset"):
        store.put_stream(failing())
    assert list(store.ids()) == []
    assert os.listdir(store.root / "tmp") == []


def test_iter_chunks_yields_the_blob(store: BlobStore, large: bytes) -> None:
    identifier = store.put(large)
    chunks = list(store.iter_chunks(identifier, chunk_size=1 << 20))
    assert b"".join(chunks) == large
    assert max(len(chunk) for chunk in chunks) == 1 << 20
    assert store.statistics().blobs_read == 1


def test_iter_chunks_raises_not_found_before_iterating(store: BlobStore) -> None:
    with pytest.raises(BlobNotFound):
        store.iter_chunks(SMALL_ID)
    with pytest.raises(LocalError, match="chunk_size must be positive"):
        store.iter_chunks(SMALL_ID, chunk_size=0)


# -- corruption ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", [len(SMALL), LARGE_SIZE])
def test_tampered_blob_is_refused_and_moved_aside(
    store: BlobStore, size: int, caplog: pytest.LogCaptureFixture
) -> None:
    data = random.Random(SEED).randbytes(size)
    identifier = store.put(data)
    flip_byte(store.path(identifier), size // 2)
    with (
        caplog.at_level(logging.WARNING, logger=blobs.__name__),
        pytest.raises(BlobCorrupted) as caught,
    ):
        store.get(identifier)
    quarantined = store.root / "corrupt" / f"{identifier}.0"
    assert caught.value.quarantined_to == str(quarantined)
    assert "Fetch it again from a peer" in str(caught.value)
    assert quarantined.is_file()
    assert not store.has(identifier)
    assert identifier not in list(store.ids())
    assert store.statistics().corruptions_detected == 1
    assert any(identifier in record.getMessage() for record in caplog.records)
    with pytest.raises(BlobNotFound):
        store.get(identifier)


def test_truncated_blob_is_refused(store: BlobStore, large: bytes) -> None:
    identifier = store.put(large)
    os.truncate(store.path(identifier), len(large) - 1)
    with pytest.raises(BlobCorrupted):
        store.get(identifier)


def test_file_shrinking_during_a_large_read_is_refused(
    store: BlobStore, large: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    identifier = store.put(large)
    real_readv = os.readv
    calls = []

    def readv_then_eof(fd: int, buffers: list[memoryview]) -> int:
        calls.append(fd)
        return real_readv(fd, [buffers[0][:1000]]) if len(calls) == 1 else 0

    monkeypatch.setattr(os, "readv", readv_then_eof)
    with pytest.raises(BlobCorrupted):
        store.get(identifier)
    assert len(calls) == 2, "the large read must use the in-place path"


def test_a_second_corruption_gets_a_new_quarantine_name(store: BlobStore) -> None:
    for expected_suffix in (0, 1):
        store.put(SMALL)
        flip_byte(store.path(SMALL_ID), 0)
        with pytest.raises(BlobCorrupted) as caught:
            store.get(SMALL_ID)
        assert caught.value.quarantined_to.endswith(f"{SMALL_ID}.{expected_suffix}")


def test_iter_chunks_raises_at_the_end_on_tampering(store: BlobStore, large: bytes) -> None:
    identifier = store.put(large)
    flip_byte(store.path(identifier), len(large) - 1)
    received = []
    with pytest.raises(BlobCorrupted):
        for chunk in store.iter_chunks(identifier, chunk_size=1 << 20):
            received.append(chunk)
    assert sum(map(len, received)) == len(large)  # the error comes after the last chunk
    assert not store.has(identifier)


def test_put_after_corruption_restores_the_blob(store: BlobStore, large: bytes) -> None:
    identifier = store.put(large)
    flip_byte(store.path(identifier), 0)
    with pytest.raises(BlobCorrupted):
        store.get(identifier)
    store.put(large)
    assert store.get(identifier) == large


# -- has / size / delete / ids ------------------------------------------------------------


def test_missing_blob(store: BlobStore) -> None:
    assert not store.has(SMALL_ID)
    for call in (store.get, store.size, store.path):
        with pytest.raises(BlobNotFound, match="fetch it from a peer first"):
            call(SMALL_ID)
    assert store.delete(SMALL_ID) is False


def test_delete(store: BlobStore) -> None:
    store.put(SMALL)
    assert store.delete(SMALL_ID) is True
    assert not store.has(SMALL_ID)
    assert store.delete(SMALL_ID) is False
    assert store.statistics().blobs_deleted == 1


def test_ids_lists_only_blobs(store: BlobStore) -> None:
    rng = random.Random(SEED)
    stored = sorted(store.put(rng.randbytes(rng.randrange(1, 500))) for _ in range(40))
    # Things that are not blobs: a temporary, a quarantined file, a stray name.
    (store.root / "tmp" / "123-abc").write_bytes(b"partial")
    (store.root / "corrupt" / f"{SMALL_ID}.0").write_bytes(b"bad")
    (store.root / stored[0][:2] / "notes.txt").write_bytes(b"")
    (store.root / "zz").mkdir()
    assert list(store.ids()) == stored, f"seed={SEED}"


def test_statistics_is_a_frozen_snapshot(store: BlobStore) -> None:
    before = store.statistics()
    store.put(SMALL)
    store.get(SMALL_ID)
    after = store.statistics()
    assert before == BlobStoreStatistics()
    assert (after.blobs_put, after.bytes_put) == (1, len(SMALL))
    assert (after.blobs_read, after.bytes_read) == (1, len(SMALL))
    with pytest.raises(AttributeError):
        after.blobs_put = 5  # type: ignore[misc]


def test_usage_counts_what_is_there_then_follows_puts_and_deletes(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    sizes = [rng.randrange(1, 500) for _ in range(12)]
    with BlobStore(tmp_path / "blobs") as first:
        ids = [first.put(rng.randbytes(size)) for size in sizes]
    with BlobStore(tmp_path / "blobs") as store:
        (store.root / "tmp" / "123-abc").write_bytes(b"not a blob")
        assert store.usage() == BlobUsage(blobs=12, bytes=sum(sizes)), f"seed={SEED}"
        store.put(b"x" * 100)
        store.put(b"x" * 100)  # a duplicate adds nothing
        assert store.delete(ids[0]) and not store.delete(ids[0])
        expected = BlobUsage(blobs=12, bytes=sum(sizes) - sizes[0] + 100)
        assert store.usage() == expected
        # a blob that stopped matching its id leaves the count as it leaves the store
        victim = ids[1]
        flip_byte(store.path(victim), 0)
        with pytest.raises(BlobCorrupted):
            store.get(victim)
        assert store.usage() == BlobUsage(blobs=11, bytes=expected.bytes - sizes[1])
        walked = sum(store.size(i) for i in store.ids())
        assert store.usage().bytes == walked


# -- open / close / temporaries -----------------------------------------------------------


def test_stale_temporaries_are_removed_on_open(tmp_path: Path) -> None:
    BlobStore(tmp_path).close()
    stale = tmp_path / "tmp" / "999-crashed"
    stale.write_bytes(b"half a blob")
    with BlobStore(tmp_path) as store:
        assert not stale.exists()
        assert store.statistics().stale_temps_removed == 1


def test_temporaries_of_a_store_still_open_are_kept(tmp_path: Path) -> None:
    first = BlobStore(tmp_path)
    in_flight = tmp_path / "tmp" / "123-writing"
    in_flight.write_bytes(b"being written")
    with BlobStore(tmp_path) as second:
        assert in_flight.exists(), "must not delete another open store's temporary"
        second.put(SMALL)
    first.close()
    with BlobStore(tmp_path):
        assert not in_flight.exists()


def test_reopen_keeps_blobs(tmp_path: Path, large: bytes) -> None:
    with BlobStore(tmp_path) as store:
        identifier = store.put(large)
    with BlobStore(tmp_path) as reopened:
        assert reopened.get(identifier) == large


def test_closed_store_refuses_writes(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    store.close()
    store.close()  # idempotent
    for data in (SMALL, SMALL + b"!", b"x" * LARGE_SIZE):
        with pytest.raises(LocalError, match="closed"):
            store.put(data)
    with pytest.raises(LocalError, match="closed"):
        store.put_stream([SMALL])


def test_garbage_collected_store_releases_its_lock(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    del store
    (tmp_path / "tmp" / "1-stale").write_bytes(b"x")
    with BlobStore(tmp_path) as reopened:
        assert reopened.statistics().stale_temps_removed == 1


def test_bad_max_blob_bytes(tmp_path: Path) -> None:
    with pytest.raises(LocalError, match="max_blob_bytes must be positive"):
        BlobStore(tmp_path, max_blob_bytes=0)


def test_unwritable_root_is_a_local_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(LocalError, match="cannot create the blob store"):
        BlobStore(tmp_path / "file" / "blobs")


# -- concurrency --------------------------------------------------------------------------


def test_concurrent_writers_same_and_different_blobs(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    payloads = [rng.randbytes(rng.choice([100, 70_000, 1_200_000])) for _ in range(6)]
    threads_per_payload = 4
    errors: list[BaseException] = []
    start = threading.Barrier(len(payloads) * threads_per_payload)
    with BlobStore(tmp_path) as store:

        def write(data: bytes) -> None:
            try:
                start.wait(timeout=30)
                for _ in range(3):
                    assert store.put(data) == blob_id(data)
                    assert store.get(blob_id(data)) == data
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=write, args=(data,))
            for data in payloads
            for _ in range(threads_per_payload)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        assert errors == [], f"seed={SEED}"
        assert sorted(store.ids()) == sorted({blob_id(data) for data in payloads})
        assert os.listdir(tmp_path / "tmp") == []
        stats = store.statistics()
        assert stats.blobs_put + stats.blobs_deduplicated == len(threads) * 3
