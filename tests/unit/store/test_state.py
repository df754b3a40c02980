"""StateStore: idempotent records, deterministic order, certified-head safety, persistence."""

from __future__ import annotations

import random
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.store.state import (
    DB_FILENAME,
    SCHEMA_VERSION,
    ConflictingCertifiedHead,
    StateStore,
    StateStoreStatistics,
    StoredCertifiedHead,
)

SEED = 99_173


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / DB_FILENAME


@pytest.fixture
def state(db_path: Path) -> Iterator[StateStore]:
    with StateStore(db_path) as opened:
        yield opened


def certificate(state: StateStore, certificate_id: str) -> str:
    state.put_record(certificate_id, "certificate", certificate_id.encode())
    return certificate_id


# -- opening ------------------------------------------------------------------------------


def test_database_uses_wal_full_sync_and_foreign_keys(state: StateStore, db_path: Path) -> None:
    assert db_path.exists()
    assert state.schema_version == SCHEMA_VERSION
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        raw.close()
    db = state._db
    assert db is not None
    assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert db.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_in_directory_opens_node_db(tmp_path: Path) -> None:
    with StateStore.in_directory(tmp_path / "data") as state:
        assert state.path == tmp_path / "data" / "node.db"
        assert state.path.exists()


def test_migrations_run_once_and_are_recorded(db_path: Path) -> None:
    StateStore(db_path).close()
    StateStore(db_path).close()
    raw = sqlite3.connect(db_path)
    try:
        versions = [row[0] for row in raw.execute("SELECT version FROM schema_version")]
    finally:
        raw.close()
    assert versions == list(range(1, SCHEMA_VERSION + 1))


def test_newer_schema_is_refused(db_path: Path) -> None:
    StateStore(db_path).close()
    raw = sqlite3.connect(db_path)
    with raw:
        raw.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION + 1,))
    raw.close()
    with pytest.raises(LocalError, match="upgrade p2ptrain"):
        StateStore(db_path)


def test_unopenable_path_is_a_local_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(LocalError, match="cannot open the state database"):
        StateStore(tmp_path / "file" / "node.db")


def test_closed_store_refuses_calls(db_path: Path) -> None:
    state = StateStore(db_path)
    state.close()
    state.close()  # idempotent
    with pytest.raises(LocalError, match="closed"):
        state.get_record("r")


# -- records ------------------------------------------------------------------------------


def test_put_record_is_idempotent(state: StateStore) -> None:
    assert state.put_record("r1", "update", b"\x00envelope", experiment_id="e", height=3)
    assert not state.put_record("r1", "update", b"\x00envelope", experiment_id="e", height=3)
    assert state.get_record("r1") == b"\x00envelope"
    assert state.count("update") == 1
    assert state.statistics() == StateStoreStatistics(records_added=1, records_already_present=1)


def test_same_id_with_other_content_is_refused(state: StateStore) -> None:
    state.put_record("r1", "update", b"one", experiment_id="e", height=3, signer="s")
    for kwargs in (
        {"envelope": b"two"},
        {"envelope": b"one", "height": 4},
        {"envelope": b"one", "signer": "t"},
    ):
        merged = {"experiment_id": "e", "height": 3, "signer": "s", **kwargs}
        with pytest.raises(LocalError, match="already stored with different content"):
            state.put_record("r1", "update", **merged)  # type: ignore[arg-type]
    assert state.get_record("r1") == b"one"


def test_get_missing_record(state: StateStore) -> None:
    assert state.get_record("nope") is None


def test_records_are_ordered_whatever_the_arrival_order(tmp_path: Path) -> None:
    rows = [
        (f"id{i:03d}", "vote", f"exp{i % 3}", i % 5, f"peer{i % 4}", bytes([i])) for i in range(60)
    ]
    listings = []
    for attempt in range(3):
        shuffled = rows[:]
        random.Random(SEED + attempt).shuffle(shuffled)
        with StateStore(tmp_path / f"node{attempt}.db") as state:
            for record_id, kind, experiment, height, signer, envelope in shuffled:
                state.put_record(
                    record_id,
                    kind,
                    envelope,
                    experiment_id=experiment,
                    height=height,
                    signer=signer,
                )
            listings.append(state.records("vote"))
    expected = [(row[0], row[5]) for row in sorted(rows, key=lambda r: (r[2], r[3], r[0]))]
    assert listings[0] == expected, f"seed={SEED}"
    assert listings[1] == listings[0] == listings[2], f"seed={SEED}"


def test_records_filter_by_kind_experiment_and_height(state: StateStore) -> None:
    state.put_record("a", "vote", b"a", experiment_id="e1", height=1)
    state.put_record("b", "vote", b"b", experiment_id="e1", height=2)
    state.put_record("c", "vote", b"c", experiment_id="e2", height=1)
    state.put_record("d", "manifest", b"d", experiment_id="e1", height=1)
    state.put_record("e", "vote", b"e")  # no experiment, no height: listed first
    assert [rid for rid, _ in state.records("vote")] == ["e", "a", "b", "c"]
    assert state.records("vote", experiment_id="e1") == [("a", b"a"), ("b", b"b")]
    assert state.records("vote", height=1) == [("a", b"a"), ("c", b"c")]
    assert state.records("vote", experiment_id="e1", height=2) == [("b", b"b")]
    assert state.records("proposal") == []
    assert (state.count("vote"), state.count("manifest"), state.count("proposal")) == (4, 1, 0)
    assert state.count("vote", experiment_id="e1", height=1) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"record_id": ""}, "record_id must be a non-empty string"),
        ({"kind": ""}, "kind must be a non-empty string"),
        ({"height": -1}, "height must be a non-negative integer"),
        ({"height": True}, "height must be a non-negative integer"),
        ({"envelope": "text"}, "envelope must be bytes"),
    ],
)
def test_put_record_checks_its_arguments(
    state: StateStore, kwargs: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {"record_id": "r", "kind": "k", "envelope": b"x", **kwargs}
    with pytest.raises(LocalError, match=message):
        state.put_record(**arguments)  # type: ignore[arg-type]


# -- certified heads ----------------------------------------------------------------------


def test_certified_head_round_trip(state: StateStore) -> None:
    cert = certificate(state, "cert-5")
    assert state.put_certified_head("exp", 5, "head-5", cert)
    assert state.certified_head("exp", 5) == StoredCertifiedHead("exp", 5, "head-5", "cert-5")
    assert state.certified_head("exp", 6) is None
    assert state.certified_head("other", 5) is None


def test_same_head_again_is_a_no_op_keeping_the_first_certificate(state: StateStore) -> None:
    state.put_certified_head("exp", 5, "head-5", certificate(state, "cert-a"))
    assert not state.put_certified_head("exp", 5, "head-5", certificate(state, "cert-b"))
    head = state.certified_head("exp", 5)
    assert head is not None and head.certificate_id == "cert-a"


def test_conflicting_certified_head_is_refused(state: StateStore) -> None:
    state.put_certified_head("exp", 5, "head-5", certificate(state, "cert-a"))
    with pytest.raises(ConflictingCertifiedHead, match="safety violation") as caught:
        state.put_certified_head("exp", 5, "evil-head", certificate(state, "cert-b"))
    assert isinstance(caught.value, ProtocolViolation)
    assert caught.value.existing == StoredCertifiedHead("exp", 5, "head-5", "cert-a")
    assert caught.value.head_id == "evil-head"
    assert state.certified_head("exp", 5) == StoredCertifiedHead("exp", 5, "head-5", "cert-a")
    assert state.statistics().conflicting_heads_refused == 1
    # Another experiment may certify anything at the same height.
    assert state.put_certified_head("exp2", 5, "evil-head", "cert-b")


def test_certified_head_needs_its_certificate_stored(state: StateStore) -> None:
    with pytest.raises(LocalError, match="store it with put_record"):
        state.put_certified_head("exp", 1, "head", "missing-cert")
    assert state.certified_head("exp", 1) is None


def test_latest_certified_head(state: StateStore) -> None:
    assert state.latest_certified_head("exp") is None
    for height in (3, 10, 7):
        state.put_certified_head("exp", height, f"h{height}", certificate(state, f"c{height}"))
    state.put_certified_head("other", 99, "h99", certificate(state, "c99"))
    assert state.latest_certified_head("exp") == StoredCertifiedHead("exp", 10, "h10", "c10")


# -- meta ---------------------------------------------------------------------------------


def test_meta_set_get_replace(state: StateStore) -> None:
    assert state.get_meta("node_id") is None
    state.set_meta("node_id", b"\x01\x02")
    assert state.get_meta("node_id") == b"\x01\x02"
    state.set_meta("node_id", b"")
    assert state.get_meta("node_id") == b""
    with pytest.raises(LocalError, match="meta value must be bytes"):
        state.set_meta("node_id", "text")  # type: ignore[arg-type]


# -- persistence and threads --------------------------------------------------------------


def test_reopen_persists_everything(db_path: Path) -> None:
    with StateStore(db_path) as state:
        state.put_record("r", "update", b"env", experiment_id="e", height=1, signer="s")
        state.put_certified_head("e", 1, "head", certificate(state, "cert"))
        state.set_meta("k", b"v")
    with StateStore(db_path) as reopened:
        assert reopened.get_record("r") == b"env"
        assert reopened.latest_certified_head("e") == StoredCertifiedHead("e", 1, "head", "cert")
        assert reopened.get_meta("k") == b"v"
        with pytest.raises(ConflictingCertifiedHead):
            reopened.put_certified_head("e", 1, "other", "cert")


def test_failed_write_rolls_back(state: StateStore) -> None:
    with pytest.raises(LocalError):
        state.put_certified_head("exp", 1, "head", "missing-cert")
    # The store is still usable: no transaction was left open.
    assert state.put_record("r", "k", b"x")
    assert state.get_record("r") == b"x"


def test_concurrent_threads(state: StateStore) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(worker: int) -> None:
        try:
            start.wait(timeout=30)
            for i in range(25):
                record_id = f"r{i}"  # every worker stores the same 25 records
                state.put_record(record_id, "vote", record_id.encode(), height=i)
                state.set_meta(f"w{worker}", str(i).encode())
                assert state.get_record(record_id) == record_id.encode()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert state.count("vote") == 25
    stats = state.statistics()
    assert (stats.records_added, stats.records_already_present) == (25, 7 * 25)
    assert all(state.get_meta(f"w{w}") == b"24" for w in range(8))


def test_two_connections_see_each_others_writes(db_path: Path) -> None:
    with StateStore(db_path) as first, StateStore(db_path) as second:
        first.put_record("r", "k", b"x")
        assert second.get_record("r") == b"x"
        assert not second.put_record("r", "k", b"x")
