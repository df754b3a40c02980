"""Content-addressed blob store: a blob's id is the SHA-256 of its bytes.

Layout under ``root``::

    root/ab/<64-hex id>   visible blobs, fanned out by the first two hex digits
    root/tmp/             temporaries; never visible as blobs
    root/corrupt/         blobs whose bytes stopped matching their id, as ``<id>.<n>``
    root/partial/         downloads in progress (:mod:`p2ptrain.net.partial_file`): the
                          partial file ``<id>`` and its record of ranges ``<id>.json``
    root/.lock            flock: shared by every open store, exclusive while cleaning tmp/

Opening a store removes the temporaries of crashed writers, unless another store (in this
or another process) is open on the same root: its temporaries may be in use, so the
cleanup waits for the next open with nobody else there.

Writes go to a unique temporary file, are fsynced, renamed into place with
:func:`os.replace` and the directory is fsynced, so a crash at any point leaves either the
whole blob or nothing visible. Every read verifies the hash; a mismatch moves the file
aside and raises :class:`~p2ptrain.errors.BlobCorrupted`.

Speed: hashing is the bottleneck (SHA-256 runs at about the speed of a page-cache copy), so
large blobs are hashed on a second thread while the first one writes or reads; hashlib and
file I/O release the GIL. :meth:`BlobStore.get` reads straight into the ``bytearray`` it
returns and hashes each chunk as soon as it lands, so the bytes returned are exactly the bytes
hashed (see :mod:`p2ptrain.store.blob_io`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import re
import tempfile
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from p2ptrain.core.spool import SpooledBlob
from p2ptrain.errors import BlobCorrupted, BlobNotFound, LocalError, ProtocolViolation
from p2ptrain.store.blob_io import (
    PARALLEL_MIN_BYTES,
    FileMapping,
    fsync_directory,
    hash_while,
    read_and_hash,
    write_all,
    write_and_sync,
)

__all__ = [
    "BlobStore",
    "BlobStoreStatistics",
    "BlobUsage",
    "blob_id",
    "validate_blob_id",
]

logger = logging.getLogger(__name__)

_ID_PATTERN = re.compile(r"[0-9a-f]{64}")
_FANOUT_PATTERN = re.compile(r"[0-9a-f]{2}")
# put_stream() reads file-like sources in chunks of this size.
_STREAM_CHUNK_BYTES = 1 << 20


class BlobFile:
    """A stored blob's file, read by range (``os.pread``); closed when dropped or by
    :meth:`close`."""

    def __init__(self, fd: int, blob_id: str, size: int) -> None:
        self._fd, self._id, self._size = fd, blob_id, size
        self._closer = weakref.finalize(self, os.close, fd)
        self._mapping = FileMapping(fd, size)

    def __len__(self) -> int:
        return self._size

    @property
    def verified_id(self) -> str:
        return self._id

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset``; :class:`OSError` past the end."""
        if offset < 0 or length < 0 or offset + length > self._size:
            raise OSError(f"bytes {offset}..{offset + length} lie outside blob {self._id[:12]}")
        data = os.pread(self._fd, length, offset)
        while len(data) < length:  # a short read (rare on regular files)
            more = os.pread(self._fd, length - len(data), offset + len(data))
            if not more:
                raise OSError(f"blob {self._id[:12]} ended at byte {offset + len(data)}")
            data += more
        return data

    def memory(self) -> memoryview | None:
        """The whole file mapped read-only, kept until this reader is dropped; None for an
        empty blob."""
        return self._mapping.memory()

    def forget(self, offset: int, length: int) -> None:
        self._mapping.forget(offset, length)

    def close(self) -> None:
        self._closer()


def blob_id(data: bytes | bytearray | memoryview) -> str:
    """Return the id of ``data``: the lowercase hex SHA-256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


def validate_blob_id(value: object) -> str:
    """Return ``value`` if it is a well-formed blob id from a peer, else raise.

    Raises :class:`ProtocolViolation`: use this on every id that arrives from the network
    before handing it to a :class:`BlobStore` (whose methods treat a malformed id as our own
    bug and raise :class:`LocalError`).
    """
    if not isinstance(value, str) or not _ID_PATTERN.fullmatch(value):
        raise ProtocolViolation(
            f"malformed blob id {value!r:.80}: a blob id is 64 lowercase hex digits "
            "(the SHA-256 of the blob)"
        )
    return value


def _require_local_id(value: str) -> None:
    if not isinstance(value, str) or not _ID_PATTERN.fullmatch(value):
        raise LocalError(
            f"malformed blob id {value!r:.80}: expected 64 lowercase hex digits; "
            "validate ids from peers with validate_blob_id() first"
        )


@dataclass(frozen=True, slots=True)
class BlobStoreStatistics:
    """Counters since the store was opened."""

    blobs_put: int = 0  # blobs made visible by this store
    blobs_deduplicated: int = 0  # puts whose blob was already there
    bytes_put: int = 0  # bytes accepted by put/put_stream, new or deduplicated
    streams_rejected: int = 0  # put_stream refused: wrong hash or too large
    blobs_read: int = 0  # verified reads (get, or an iter_chunks run to the end)
    bytes_read: int = 0
    corruptions_detected: int = 0  # reads that found bytes not matching the id
    blobs_deleted: int = 0
    stale_temps_removed: int = 0  # temporaries of crashed writers removed on open


@dataclass(frozen=True, slots=True)
class BlobUsage:
    """What the store holds: visible blobs and their bytes (temporaries, partial downloads
    and quarantined files not counted)."""

    blobs: int = 0
    bytes: int = 0


class BlobStore:
    """A directory of immutable blobs named by the SHA-256 of their bytes.

    Safe for concurrent writers and readers, both threads and processes. Hold it open for
    the life of the node and :meth:`close` it (or use it as a context manager).
    """

    def __init__(self, root: str | os.PathLike[str], *, max_blob_bytes: int = 8 << 30) -> None:
        if max_blob_bytes <= 0:
            raise LocalError(f"max_blob_bytes must be positive, got {max_blob_bytes}")
        self._root = Path(root)
        self._tmp = self._root / "tmp"
        self._corrupt = self._root / "corrupt"
        self._max_blob_bytes = max_blob_bytes
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(BlobStoreStatistics.__slots__, 0)
        self._known_dirs: set[str] = set()
        #: Held while blobs appear or vanish and while they are counted, so that a count
        #: and the changes around it agree (:meth:`usage`).
        self._usage_lock = threading.Lock()
        self._usage: BlobUsage | None = None  # None: not counted yet
        try:
            for directory in (self._root, self._tmp, self._corrupt):
                directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LocalError(
                f"cannot create the blob store at {self._root}: {exc}; "
                "choose a writable data directory"
            ) from exc
        # The lock lives as long as this object: close() or garbage collection releases it.
        self._release = weakref.finalize(self, os.close, self._open_and_clean())

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def root(self) -> Path:
        """The directory the store lives in."""
        return self._root

    def close(self) -> None:
        """Release the store; later writes raise :class:`LocalError`. Idempotent."""
        self._release()  # closing the lock file releases the shared flock

    def __enter__(self) -> BlobStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def statistics(self) -> BlobStoreStatistics:
        """A snapshot of this store's counters."""
        with self._lock:
            return BlobStoreStatistics(**self._counts)

    def usage(self) -> BlobUsage:
        """How many blobs the store holds and their bytes. The first call counts them (it
        walks the store: call it off the event loop on a large one); this store's writes
        and deletes keep the count up to date after that (another process writing the
        same root is not seen)."""
        with self._usage_lock:
            if self._usage is None:
                blobs = total = 0
                for blob_id in self.ids():
                    try:
                        total += self._path(blob_id).stat().st_size
                    except FileNotFoundError:  # deleted by another process meanwhile
                        continue
                    blobs += 1
                self._usage = BlobUsage(blobs, total)
            return self._usage

    # -- writing -------------------------------------------------------------------------

    def put(self, data: bytes | bytearray | memoryview) -> str:
        """Store ``data`` durably and return its id. Storing a blob twice is harmless."""
        self._require_open()
        view = memoryview(data).cast("B")
        if view.nbytes > self._max_blob_bytes:
            raise LocalError(
                f"blob of {view.nbytes} bytes exceeds max_blob_bytes={self._max_blob_bytes}; "
                "split it or open the store with a larger max_blob_bytes"
            )
        if view.nbytes < PARALLEL_MIN_BYTES:
            digest = blob_id(view)
            if self.has(digest):
                self._count(blobs_deduplicated=1, bytes_put=view.nbytes)
                return digest
            with self._temporary() as (fd, tmp_path):
                write_all(fd, view)
                os.fsync(fd)
                return self._publish(tmp_path, digest, view.nbytes)
        with self._temporary() as (fd, tmp_path):
            digest = hash_while(view, lambda: write_and_sync(fd, view))
            return self._publish(tmp_path, digest, view.nbytes)

    def put_stream(
        self,
        chunks: Iterable[bytes] | BinaryIO,
        *,
        expected_id: str | None = None,
        max_bytes: int | None = None,
    ) -> str:
        """Store a blob read from ``chunks`` (an iterable of bytes or a binary file).

        Memory stays bounded by one chunk. If the bytes do not hash to ``expected_id``, or
        there are more than ``max_bytes`` (or ``max_blob_bytes``) of them, nothing becomes
        visible and :class:`ProtocolViolation` is raised: streams are how peers send blobs.
        """
        if expected_id is not None:
            _require_local_id(expected_id)
        if max_bytes is not None and max_bytes < 0:
            raise LocalError(f"max_bytes must not be negative, got {max_bytes}")
        limit = self._max_blob_bytes if max_bytes is None else min(max_bytes, self._max_blob_bytes)
        hasher = hashlib.sha256()
        total = 0
        with self._temporary() as (fd, tmp_path):
            for chunk in _chunks_of(chunks):
                total += len(chunk)
                if total > limit:
                    self._count(streams_rejected=1)
                    raise ProtocolViolation(
                        f"blob stream exceeds its limit of {limit} bytes; refused it "
                        "(nothing was stored)"
                    )
                hasher.update(chunk)
                write_all(fd, memoryview(chunk))
            digest = hasher.hexdigest()
            if expected_id is not None and digest != expected_id:
                self._count(streams_rejected=1)
                raise ProtocolViolation(
                    f"blob stream hashes to {digest}, not to the expected id {expected_id}; "
                    "refused it (nothing was stored). Fetch it again, from another peer"
                )
            os.fsync(fd)
            return self._publish(tmp_path, digest, total)

    def adopt_verified(self, path: str | os.PathLike[str], blob_id: str, size: int) -> str:
        """Make the file at ``path``, whose bytes the caller has checked hash to ``blob_id``,
        visible as that blob: fsync it and rename it into place. Returns ``blob_id``.

        The store does not re-hash the file: only pass files you verified yourself (the
        blob fetcher hashes while it downloads). ``path`` must be on the store's filesystem,
        e.g. a directory under :attr:`root`; it is gone afterwards (also when the blob was
        already there).
        """
        self._require_open()
        _require_local_id(blob_id)
        source = Path(path)
        if size > self._max_blob_bytes:
            raise LocalError(
                f"blob of {size} bytes exceeds max_blob_bytes={self._max_blob_bytes}; "
                "open the store with a larger max_blob_bytes"
            )
        fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise LocalError(
                    f"{source} holds {actual} bytes, not the {size} of blob {blob_id}; "
                    "adopt only the complete, verified file"
                )
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            return self._publish(str(source), blob_id, size)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            raise LocalError(
                f"cannot move {source} into the blob store at {self._root}: {exc}; "
                "keep files to adopt on the store's filesystem (under its root)"
            ) from exc

    def adopt(self, blob: SpooledBlob) -> str:
        """Make a blob spooled under :attr:`spool_directory` visible, by renaming its file
        (its id, hashed when it was spooled or now, is trusted: it is our own). Returns the
        id; the spooled blob reads on from the store's file."""
        blob_id = self.adopt_verified(blob.path, blob.blob_id, len(blob))
        blob.adopted(str(self._path(blob_id)))
        return blob_id

    @property
    def spool_directory(self) -> Path:
        """Where to spool blobs this store will adopt (:class:`~p2ptrain.store.spool.FileSpool`):
        its temporaries, on its filesystem, cleared of a crashed run's files."""
        return self._tmp

    # -- reading -------------------------------------------------------------------------

    def get(self, blob_id: str) -> bytearray:
        """Return the blob's bytes (a fresh buffer) after checking they hash to ``blob_id``.

        Raises :class:`BlobNotFound` or, when the file is damaged, :class:`BlobCorrupted`
        (the file is moved aside to ``root/corrupt``).
        """
        fd = self._open_blob(blob_id)
        try:
            status = os.fstat(fd)
            data, digest = read_and_hash(fd, status.st_size)
            if digest != blob_id:
                self._quarantine(blob_id, status)
        finally:
            os.close(fd)
        self._count(blobs_read=1, bytes_read=len(data))
        return data

    def reader(self, blob_id: str) -> BlobFile:
        """The blob, read by range (a reduction reads one window of every update at a time,
        never an update whole). Its bytes are trusted to hash to ``blob_id`` as they did
        when the store took them in (every way in hashes them), not re-hashed: a file that
        rots on disk afterwards gives a head the quorum does not reach, and the node then
        fetches the certified state. Raises :class:`BlobNotFound`."""
        fd = self._open_blob(blob_id)
        self._count(blobs_read=1)
        return BlobFile(fd, blob_id, os.fstat(fd).st_size)

    def iter_chunks(self, blob_id: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        """Yield the blob in chunks; verify the hash at the end.

        :class:`BlobNotFound` is raised here, before iteration. If the bytes do not match,
        :class:`BlobCorrupted` is raised after the last chunk: discard everything received.
        """
        if chunk_size <= 0:
            raise LocalError(f"chunk_size must be positive, got {chunk_size}")
        self.size(blob_id)  # raises BlobNotFound now rather than on first next()
        return self._verified_chunks(blob_id, chunk_size)

    def has(self, blob_id: str) -> bool:
        """Whether a blob with this id is visible (its bytes are not checked)."""
        return self._path(blob_id).is_file()

    def size(self, blob_id: str) -> int:
        """The blob's size in bytes; raises :class:`BlobNotFound`."""
        try:
            return self._path(blob_id).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(blob_id) from None

    def path(self, blob_id: str) -> Path:
        """The blob's file, for serving it with ``sendfile`` and the like.

        UNVERIFIED: the file may have rotted since it was written. Readers of this path must
        check the hash themselves (peers do on receipt). Raises :class:`BlobNotFound`.
        """
        path = self._path(blob_id)
        if not path.is_file():
            raise BlobNotFound(blob_id)
        return path

    def delete(self, blob_id: str) -> bool:
        """Remove a blob; return whether it was there. Not fsynced: a crash may revive it."""
        path = self._path(blob_id)
        with self._usage_lock:
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                return False
            self._changed(-1, -size)
        self._count(blobs_deleted=1)
        return True

    def ids(self) -> Iterator[str]:
        """The ids of the visible blobs, sorted (the bytes are not checked)."""
        for fanout in sorted(_subdirectory_names(self._root)):
            if not _FANOUT_PATTERN.fullmatch(fanout):
                continue
            names = sorted(os.listdir(self._root / fanout))
            yield from (n for n in names if _ID_PATTERN.fullmatch(n) and n[:2] == fanout)

    # -- internals -----------------------------------------------------------------------

    def _path(self, blob_id: str) -> Path:
        _require_local_id(blob_id)
        return self._root / blob_id[:2] / blob_id

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _changed(self, blobs: int, nbytes: int) -> None:
        """Blobs appeared or vanished (the caller holds ``_usage_lock``)."""
        if self._usage is not None:
            self._usage = BlobUsage(self._usage.blobs + blobs, self._usage.bytes + nbytes)

    def _open_and_clean(self) -> int:
        """Take the store's shared lock, removing stale temporaries if we are alone.

        A process that can take the lock exclusively knows no other store is open on this
        root, so every file in tmp/ belongs to a writer that died. The lock dies with its
        process, so a crashed writer never blocks the cleanup.
        """
        fd = os.open(self._root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # another store is open here; its temporaries may be live
        else:
            self._remove_stale_temps()
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def _remove_stale_temps(self) -> None:
        removed = 0
        for entry in os.scandir(self._tmp):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed += 1
        if removed:
            logger.info("removed %d stale temporary file(s) from %s", removed, self._tmp)
            self._count(stale_temps_removed=removed)

    def _require_open(self) -> None:
        if not self._release.alive:
            raise LocalError(f"the blob store at {self._root} is closed; open a new BlobStore")

    def _temporary(self) -> _Temporary:
        self._require_open()
        return _Temporary(self._tmp)

    def _publish(self, tmp_path: str, digest: str, nbytes: int) -> str:
        """Make the fsynced temporary visible as ``digest``, unless it already is."""
        directory = self._root / digest[:2]
        self._ensure_directory(directory)
        final = directory / digest
        with self._usage_lock:
            duplicate = final.exists()
            if not duplicate:
                os.replace(tmp_path, final)
                self._changed(1, nbytes)
        if duplicate:
            os.unlink(tmp_path)
            self._count(blobs_deduplicated=1, bytes_put=nbytes)
            return digest
        fsync_directory(directory)
        self._count(blobs_put=1, bytes_put=nbytes)
        return digest

    def _ensure_directory(self, directory: Path) -> None:
        if directory.name in self._known_dirs:
            return
        try:
            directory.mkdir()
        except FileExistsError:
            pass
        else:
            fsync_directory(self._root)
        self._known_dirs.add(directory.name)

    def _open_blob(self, blob_id: str) -> int:
        try:
            return os.open(self._path(blob_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise BlobNotFound(blob_id) from None

    def _verified_chunks(self, blob_id: str, chunk_size: int) -> Iterator[bytes]:
        fd = self._open_blob(blob_id)
        try:
            status = os.fstat(fd)
            hasher = hashlib.sha256()
            total = 0
            while chunk := os.read(fd, chunk_size):
                hasher.update(chunk)
                total += len(chunk)
                yield chunk
            if hasher.hexdigest() != blob_id:
                self._quarantine(blob_id, status)
        finally:
            os.close(fd)
        self._count(blobs_read=1, bytes_read=total)

    def _quarantine(self, blob_id: str, status: os.stat_result) -> None:
        """Move the damaged file aside to ``corrupt/<id>.<n>`` and raise BlobCorrupted."""
        self._count(corruptions_detected=1)
        source = self._path(blob_id)
        destination = "(nowhere: another reader moved it, or a fresh copy replaced it)"
        with self._usage_lock:  # blobs appear and vanish under this lock: the file stays put
            try:
                current = source.stat()
            except FileNotFoundError:
                current = None
            if current is not None and (current.st_ino, current.st_dev) == (
                status.st_ino,
                status.st_dev,
            ):
                moved = _move_to_free_name(source, self._corrupt, blob_id)
                if moved is None:
                    destination = "(nowhere: another process moved it first)"
                else:
                    destination = moved
                    self._changed(-1, -current.st_size)
        logger.warning("blob %s does not match its id; moved aside to %s", blob_id, destination)
        raise BlobCorrupted(blob_id, destination)


class _Temporary:
    """A unique temporary file in tmp/; removed on error unless published."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._fd = -1
        self._path = ""

    def __enter__(self) -> tuple[int, str]:
        self._fd, self._path = tempfile.mkstemp(prefix=f"{os.getpid()}-", dir=self._directory)
        return self._fd, self._path

    def __exit__(self, exc_type: object, *rest: object) -> None:
        os.close(self._fd)
        if exc_type is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)


def _chunks_of(source: Iterable[bytes] | BinaryIO) -> Iterator[bytes]:
    read = getattr(source, "read", None)
    if read is None:
        yield from source
        return
    while chunk := read(_STREAM_CHUNK_BYTES):
        yield chunk


def _subdirectory_names(directory: Path) -> Iterator[str]:
    with os.scandir(directory) as entries:
        yield from (entry.name for entry in entries if entry.is_dir(follow_symlinks=False))


def _move_to_free_name(source: Path, directory: Path, stem: str) -> str | None:
    """Move ``source`` to ``directory/<stem>.<n>`` (the first free n); None if it is gone."""
    for n in itertools.count():
        destination = directory / f"{stem}.{n}"
        try:
            os.link(source, destination)  # fails rather than overwrite another copy
        except FileExistsError:
            continue
        except FileNotFoundError:
            return None
        os.unlink(source)
        return str(destination)
    raise AssertionError("unreachable")
