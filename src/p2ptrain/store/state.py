"""The node's state database: signed records, certified heads and a little metadata.

One SQLite file (``node.db``) in WAL mode, so readers never block the writer. The store keeps
the bytes it is given and never decodes them; callers index each record by kind, experiment,
height and signer when they store it.

``synchronous=FULL``: every committed transaction is on disk before the call returns. The
records include our own signed votes and certificates; with ``NORMAL`` a power cut could
forget a vote we already sent, and after the restart we might sign a conflicting one. Records
arrive at window rate, not packet rate, so the extra fsync per commit is cheap.

The schema evolves by numbered migrations: :data:`_MIGRATIONS` ``[n - 1]`` takes the schema
from version ``n - 1`` to ``n``, and ``schema_version`` remembers which ones ran.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from p2ptrain.errors import LocalError, ProtocolViolation, TransportError

__all__ = [
    "DB_FILENAME",
    "SCHEMA_VERSION",
    "ConflictingCertifiedHead",
    "StateStore",
    "StateStoreStatistics",
    "StoredCertifiedHead",
]

DB_FILENAME = "node.db"

_MIGRATIONS: tuple[str, ...] = (
    # 1: records, meta, certified heads
    """
    CREATE TABLE records (
        record_id     TEXT PRIMARY KEY,
        kind          TEXT NOT NULL,
        experiment_id TEXT,
        height        INTEGER CHECK (height >= 0),
        signer        TEXT,
        envelope      BLOB NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX records_by_kind ON records (kind, experiment_id, height, record_id);
    CREATE TABLE meta (
        key   TEXT PRIMARY KEY,
        value BLOB NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE certified_heads (
        experiment_id  TEXT NOT NULL,
        height         INTEGER NOT NULL CHECK (height >= 0),
        head_id        TEXT NOT NULL,
        certificate_id TEXT NOT NULL REFERENCES records (record_id),
        PRIMARY KEY (experiment_id, height)
    ) WITHOUT ROWID;
    """,
)
SCHEMA_VERSION = len(_MIGRATIONS)


class ConflictingCertifiedHead(ProtocolViolation):
    """A second, different head was offered as certified at an already certified height.

    Two certified heads at one height is a safety violation: either the signers of both
    certificates equivocated or the quorum rules are broken. The first head is kept.
    """

    def __init__(self, existing: StoredCertifiedHead, head_id: str, certificate_id: str) -> None:
        super().__init__(
            f"refused to certify head {head_id} (certificate {certificate_id}) at height "
            f"{existing.height} of experiment {existing.experiment_id}: head "
            f"{existing.head_id} is already certified there (certificate "
            f"{existing.certificate_id}). This is a safety violation; keep the first head and "
            "report both certificates: their common signers equivocated"
        )
        self.existing = existing
        self.head_id = head_id
        self.certificate_id = certificate_id


@dataclass(frozen=True, slots=True)
class StoredCertifiedHead:
    """The head certified at one height of one experiment, and the certificate proving it,
    by id, as the state store keeps them (:class:`p2ptrain.protocol.chain.CertifiedHead` is
    the chain's link, with the records themselves)."""

    experiment_id: str
    height: int
    head_id: str
    certificate_id: str


@dataclass(frozen=True, slots=True)
class StateStoreStatistics:
    """Counters since the store was opened."""

    records_added: int = 0
    records_already_present: int = 0
    records_pruned: int = 0
    certified_heads_added: int = 0
    conflicting_heads_refused: int = 0


class StateStore:
    """SQLite-backed node state. Thread-safe: one connection behind a lock."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(StateStoreStatistics.__slots__, 0)
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._db: sqlite3.Connection | None = sqlite3.connect(
                self._path, timeout=10.0, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as exc:
            raise LocalError(
                f"cannot open the state database {self._path}: {exc}; "
                "check the data directory exists and is writable"
            ) from exc
        try:
            self._configure()
            self._migrate()
        except BaseException:
            self.close()
            raise

    @classmethod
    def in_directory(cls, data_dir: str | os.PathLike[str]) -> StateStore:
        """Open ``<data_dir>/node.db``."""
        return cls(Path(data_dir) / DB_FILENAME)

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    @property
    def schema_version(self) -> int:
        """The schema version of the open database."""
        with self._transaction() as db:
            return _current_version(db)

    def close(self) -> None:
        """Close the database; later calls raise :class:`LocalError`. Idempotent."""
        with self._lock:
            db, self._db = self._db, None
        if db is not None:
            db.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def statistics(self) -> StateStoreStatistics:
        """A snapshot of this store's counters."""
        with self._lock:
            return StateStoreStatistics(**self._counts)

    # -- records -------------------------------------------------------------------------

    def put_record(
        self,
        record_id: str,
        kind: str,
        envelope: bytes,
        *,
        experiment_id: str | None = None,
        height: int | None = None,
        signer: str | None = None,
    ) -> bool:
        """Store a signed record; return False if it was already stored (a no-op).

        Raises :class:`LocalError` if ``record_id`` is already stored with other bytes or
        another index: record ids are content hashes, so that is a bug in the caller.
        """
        _require_text("record_id", record_id)
        _require_text("kind", kind)
        _require_height(height)
        if not isinstance(envelope, bytes):
            raise LocalError(f"envelope must be bytes, got {type(envelope).__name__}")
        row = (record_id, kind, experiment_id, height, signer, envelope)
        stored: tuple[object, ...] | None = None
        with self._transaction(write=True) as db:
            inserted = db.execute(
                "INSERT INTO records (record_id, kind, experiment_id, height, signer, envelope)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (record_id) DO NOTHING",
                row,
            ).rowcount
            if not inserted:
                stored = db.execute(
                    "SELECT record_id, kind, experiment_id, height, signer, envelope"
                    " FROM records WHERE record_id = ?",
                    (record_id,),
                ).fetchone()
        if inserted:
            self._count(records_added=1)
            return True
        if stored is not None and tuple(stored) != row:
            raise LocalError(
                f"record {record_id} is already stored with different content or index; "
                "record ids must be the hash of the envelope — check how the id was computed"
            )
        self._count(records_already_present=1)
        return False

    def prune_records(self, kinds: Sequence[str], experiment_id: str, below_height: int) -> int:
        """Delete the records of ``kinds`` of one experiment below ``below_height`` (records
        a certificate refers to are never of these kinds); return how many went."""
        _require_height(below_height)
        marks = ", ".join("?" for _ in kinds)
        with self._transaction(write=True) as db:
            deleted = db.execute(
                f"DELETE FROM records WHERE kind IN ({marks}) AND experiment_id = ? AND height < ?",
                (*kinds, experiment_id, below_height),
            ).rowcount
        self._count(records_pruned=deleted)
        return int(deleted)

    def get_record(self, record_id: str) -> bytes | None:
        """The envelope stored under ``record_id``, or None."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT envelope FROM records WHERE record_id = ?", (record_id,)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def records(
        self, kind: str, *, experiment_id: str | None = None, height: int | None = None
    ) -> list[tuple[str, bytes]]:
        """``(record_id, envelope)`` of a kind, optionally of one experiment and height.

        Ordered by experiment, height, then record id (records without an experiment or
        height first), so every node lists the same set the same way whatever order the
        records arrived in.
        """
        where, params = _record_filter(kind, experiment_id, height)
        with self._transaction() as db:
            rows = db.execute(
                f"SELECT record_id, envelope FROM records WHERE {where}"
                " ORDER BY experiment_id, height, record_id",
                params,
            ).fetchall()
        return [(str(record_id), bytes(envelope)) for record_id, envelope in rows]

    def record_ids(self, kind: str, *, experiment_id: str, height: int, limit: int) -> list[str]:
        """The ids of at most ``limit`` records of a kind at one experiment and height (in
        id order): what a peer asks to learn which records it lacks."""
        where, params = _record_filter(kind, experiment_id, height)
        with self._transaction() as db:
            rows = db.execute(
                f"SELECT record_id FROM records WHERE {where} ORDER BY record_id LIMIT ?",
                (*params, limit),
            ).fetchall()
        return [str(row[0]) for row in rows]

    def count(
        self, kind: str, *, experiment_id: str | None = None, height: int | None = None
    ) -> int:
        """How many records of a kind (optionally of one experiment and height) are stored."""
        where, params = _record_filter(kind, experiment_id, height)
        with self._transaction() as db:
            (total,) = db.execute(f"SELECT COUNT(*) FROM records WHERE {where}", params).fetchone()
        return int(total)

    # -- certified heads -----------------------------------------------------------------

    def put_certified_head(
        self, experiment_id: str, height: int, head_id: str, certificate_id: str
    ) -> bool:
        """Record that ``head_id`` is certified at ``height``; False if it already was.

        The certificate must already be stored with :meth:`put_record`. Raises
        :class:`ConflictingCertifiedHead` if another head is certified at this height.
        """
        _require_text("experiment_id", experiment_id)
        _require_height(height)
        _require_text("head_id", head_id)
        _require_text("certificate_id", certificate_id)
        with self._transaction(write=True) as db:
            existing = _certified_head(db, experiment_id, height)
            if existing is None:
                _require_record(db, certificate_id)
                db.execute(
                    "INSERT INTO certified_heads VALUES (?, ?, ?, ?)",
                    (experiment_id, height, head_id, certificate_id),
                )
        if existing is None:
            self._count(certified_heads_added=1)
            return True
        if existing.head_id != head_id:
            self._count(conflicting_heads_refused=1)
            raise ConflictingCertifiedHead(existing, head_id, certificate_id)
        return False  # the same head again, perhaps by another certificate: keep the first

    def certified_head(self, experiment_id: str, height: int) -> StoredCertifiedHead | None:
        """The head certified at ``height`` of the experiment, or None."""
        with self._transaction() as db:
            return _certified_head(db, experiment_id, height)

    def certified_height(self, experiment_id: str, head_id: str) -> int | None:
        """The height at which ``head_id`` is certified in the experiment, or None."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT height FROM certified_heads WHERE experiment_id = ? AND head_id = ?",
                (experiment_id, head_id),
            ).fetchone()
        return None if row is None else int(row[0])

    def latest_certified_head(self, experiment_id: str) -> StoredCertifiedHead | None:
        """The certified head with the greatest height in the experiment, or None."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT experiment_id, height, head_id, certificate_id FROM certified_heads"
                " WHERE experiment_id = ? ORDER BY height DESC LIMIT 1",
                (experiment_id,),
            ).fetchone()
        return None if row is None else StoredCertifiedHead(*row)

    # -- meta ----------------------------------------------------------------------------

    def set_meta(self, key: str, value: bytes) -> None:
        """Set (or replace) a metadata value."""
        _require_text("key", key)
        if not isinstance(value, bytes):
            raise LocalError(f"meta value must be bytes, got {type(value).__name__}")
        with self._transaction(write=True) as db:
            db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    def get_meta(self, key: str) -> bytes | None:
        """A metadata value, or None."""
        with self._transaction() as db:
            row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    # -- internals -----------------------------------------------------------------------

    @contextmanager
    def _transaction(self, *, write: bool = False) -> Iterator[sqlite3.Connection]:
        """Hold the lock (and, for writes, SQLite's write lock) around one transaction."""
        with self._lock:
            if self._db is None:
                raise LocalError(f"the state store {self._path} is closed; open a new StateStore")
            db = self._db
            try:
                if not write:
                    yield db
                    return
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                raise TransportError(
                    f"state database {self._path} failed: {exc}; retry, and check the disk "
                    "if it persists"
                ) from exc

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _configure(self) -> None:
        assert self._db is not None
        (mode,) = self._db.execute("PRAGMA journal_mode = WAL").fetchone()
        if str(mode).lower() != "wal":
            raise LocalError(
                f"the state database {self._path} cannot use WAL mode (got {mode!r}); "
                "put the data directory on a local filesystem"
            )
        self._db.execute("PRAGMA synchronous = FULL")
        self._db.execute("PRAGMA foreign_keys = ON")

    def _migrate(self) -> None:
        with self._transaction(write=True) as db:
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY)")
            version = _current_version(db)
            if version > SCHEMA_VERSION:
                raise LocalError(
                    f"the state database {self._path} has schema version {version}, newer "
                    f"than this p2ptrain understands ({SCHEMA_VERSION}); upgrade p2ptrain"
                )
            for number in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[number - 1].split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (number,))


def _current_version(db: sqlite3.Connection) -> int:
    (version,) = db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
    return int(version)


def _certified_head(
    db: sqlite3.Connection, experiment_id: str, height: int
) -> StoredCertifiedHead | None:
    row = db.execute(
        "SELECT experiment_id, height, head_id, certificate_id FROM certified_heads"
        " WHERE experiment_id = ? AND height = ?",
        (experiment_id, height),
    ).fetchone()
    return None if row is None else StoredCertifiedHead(*row)


def _require_record(db: sqlite3.Connection, record_id: str) -> None:
    row = db.execute("SELECT 1 FROM records WHERE record_id = ?", (record_id,)).fetchone()
    if row is None:
        raise LocalError(
            f"certificate {record_id} is not stored; store it with put_record() before "
            "put_certified_head()"
        )


def _record_filter(
    kind: str, experiment_id: str | None, height: int | None
) -> tuple[str, tuple[str | int, ...]]:
    clauses = ["kind = ?"]
    params: list[str | int] = [kind]
    if experiment_id is not None:
        clauses.append("experiment_id = ?")
        params.append(experiment_id)
    if height is not None:
        clauses.append("height = ?")
        params.append(height)
    return " AND ".join(clauses), tuple(params)


def _require_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise LocalError(f"{name} must be a non-empty string, got {value!r:.80}")


def _require_height(height: object) -> None:
    if height is None:
        return
    if isinstance(height, bool) or not isinstance(height, int) or height < 0:
        raise LocalError(f"height must be a non-negative integer, got {height!r}")
