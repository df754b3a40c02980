"""A blob being downloaded: its partial file, the record of ranges on disk, and the thread
that hashes its contiguous prefix as it grows."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import queue
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from p2ptrain.errors import LocalError, ProtocolViolation, StorageFault, TransportError

logger = logging.getLogger(__name__)

#: Where downloads in progress live, under the blob store's root.
PARTIAL_DIR = "partial"
_ID_PREFIX = re.compile(r"[0-9a-f]{64}")

#: The prefix hasher waits for this many new bytes before an update (fewer, larger calls),
_HASH_MIN_BYTES = 1 << 20
#: The prefix hasher hashes at most this many per call (so closing it never waits long).
HASH_STEP_BYTES = 8 << 20
_RECORD_VERSION = 1


class PartialBlob:
    """``<root>/partial/<id>`` (the bytes so far, preallocated) and ``<id>.json`` (the
    ranges on disk). An exclusive flock on the file keeps two processes from fetching the
    same blob into the same store at once."""

    def __init__(self, directory: Path, blob_id: str, size: int) -> None:
        self.directory = directory
        self.blob_id = blob_id
        self.size = size
        self.path = directory / blob_id
        self._record = directory / f"{blob_id}.json"
        self.fd = -1
        #: Byte ranges an earlier fetch left on disk.
        self.completed: list[tuple[int, int]] = []
        self._kept = False  # whether the progress record names any bytes

    def __enter__(self) -> PartialBlob:
        self.completed = self._open()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is not None and (issubclass(exc_type, ProtocolViolation) or not self._kept):
            self.forget()  # nothing on disk, or bytes not worth resuming from
        self.close()

    def _open(self) -> list[tuple[int, int]]:
        """Open (or create) the partial file; return the ranges an earlier fetch left."""
        try:
            self.directory.mkdir(exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise LocalError(
                f"cannot create {self.path}: {exc}; the blob store's directory must be writable"
            ) from exc
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise TransportError(
                f"blob {self.blob_id} is being fetched into this store by another process; "
                "retry when it is done"
            ) from None
        ranges = self._load_record()
        self._kept = bool(ranges)
        if not ranges:
            os.ftruncate(self.fd, 0)
        try:
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self.close()
                raise StorageFault(
                    str(self.directory), f"no room for the {self.size} bytes of blob {self.blob_id}"
                ) from exc
            os.ftruncate(self.fd, max(self.size, os.fstat(self.fd).st_size))
        return ranges

    def _load_record(self) -> list[tuple[int, int]]:
        try:
            text = self._record.read_text()
        except FileNotFoundError:
            return []
        try:
            record = json.loads(text)
            if record["version"] != _RECORD_VERSION or record["size"] != self.size:
                return []
            ranges = [(int(a), int(b)) for a, b in record["ranges"]]
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the unreadable progress record %s: %s", self._record, exc)
            return []
        if os.fstat(self.fd).st_size != self.size or any(
            not 0 <= a < b <= self.size for a, b in ranges
        ):
            return []
        return ranges

    def save(self, ranges: list[tuple[int, int]]) -> None:
        """Record the ranges on disk (atomically; not fsynced: after a power cut the fetch
        may resume from zeros, which the final hash catches and a re-fetch repairs)."""
        self._kept = bool(ranges)
        staged = self._record.with_suffix(".json.new")
        record = {"version": _RECORD_VERSION, "size": self.size, "ranges": ranges}
        staged.write_text(json.dumps(record))
        os.replace(staged, self._record)

    def forget(self, *, keep_bytes: bool = False) -> None:
        """Remove the progress record and re-fetch files (and the bytes unless asked)."""
        names = [f"{self.blob_id}.json", *self._round_names()]
        if not keep_bytes:
            names.append(self.blob_id)
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / name)

    def _round_names(self) -> list[str]:
        prefix = f"{self.blob_id}.round"
        return [n for n in os.listdir(self.directory) if n.startswith(prefix)]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True, slots=True)
class PartialDownload:
    """The files a download of ``blob_id`` left in a partial directory: the partial file,
    its record of ranges and re-fetch files (``<id>``, ``<id>.json``, ``<id>.round<n>``)."""

    blob_id: str
    names: tuple[str, ...]
    bytes: int
    #: The newest modification time among them (seconds since the epoch).
    modified: float


def partial_downloads(directory: Path) -> list[PartialDownload]:
    """The downloads with files in ``directory`` (none if it does not exist), by blob id."""
    found: dict[str, list[tuple[str, os.stat_result]]] = {}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        match = _ID_PREFIX.match(entry.name)
        if match is None:
            continue
        try:
            status = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        found.setdefault(match.group(), []).append((entry.name, status))
    return [
        PartialDownload(
            blob_id=blob_id,
            names=tuple(sorted(name for name, _ in files)),
            bytes=sum(status.st_size for _, status in files),
            modified=max(status.st_mtime for _, status in files),
        )
        for blob_id, files in sorted(found.items())
    ]


def remove_partial(download: PartialDownload, directory: Path, *, unless_newer: float) -> bool:
    """Remove a download's files unless somebody is downloading the blob now (the fetcher
    holds the partial file's flock) or wrote to it after ``unless_newer`` (epoch seconds);
    return whether they were removed. The lock is held while they go, so no fetch starts
    on them meanwhile."""
    path = directory / download.blob_id
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1  # only records left: nobody can be fetching into them
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a fetch is under way
            if os.fstat(fd).st_mtime > unless_newer:
                return False  # written since it was listed
        for name in download.names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)
        return True
    finally:
        if fd >= 0:
            os.close(fd)


class PrefixHasher:
    """SHA-256 of the partial file's prefix, on a worker thread, as the prefix grows.

    It reads through a shared read-only mapping of the file, so hashing costs no copy
    (the file is preallocated to its full size first, so the mapping never reaches past the
    end of the file); hashlib releases the GIL for large updates.
    """

    def __init__(self, fd: int, size: int) -> None:
        self._size = size
        self._queued = 0
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._digest: str | None = None
        self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        self._map.madvise(mmap.MADV_SEQUENTIAL)
        self._thread = threading.Thread(target=self._run, name="blob-fetch-hash", daemon=True)
        self._thread.start()

    def __enter__(self) -> PrefixHasher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def advance(self, end: int) -> None:
        """Bytes ``[0, end)`` are on disk."""
        if end >= self._queued + _HASH_MIN_BYTES or (end == self._size > self._queued):
            self._queued = end
            self._queue.put(end)

    async def digest(self) -> str:
        """The hex digest, once ``advance(size)`` was called."""
        await asyncio.to_thread(self._thread.join)
        if self._digest is None:
            raise LocalError("the prefix hasher stopped before the end of the blob")
        return self._digest

    def close(self) -> None:
        self._queue.put(-1)
        self._thread.join()
        self._map.close()

    def _run(self) -> None:
        hasher = hashlib.sha256()
        view = memoryview(self._map)
        done = 0
        try:
            while done < self._size:
                target = self._queue.get()
                if target < 0:
                    return
                while done < target:
                    step = min(target, done + HASH_STEP_BYTES)
                    hasher.update(view[done:step])
                    done = step
            self._digest = hasher.hexdigest()
        finally:
            view.release()


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    written = os.pwrite(fd, data, offset)
    if written < len(data):
        view = memoryview(data)
        while written < len(view):
            written += os.pwrite(fd, view[written:], offset + written)


def range_digest(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb", buffering=0) as file:
        hasher = hashlib.sha256()
        hash_range(file.fileno(), start, end, hasher)
        return hasher.digest()


def hash_range(fd: int, start: int, end: int, hasher: hashlib._Hash) -> None:
    buffer = bytearray(min(HASH_STEP_BYTES, max(end - start, 1)))
    view = memoryview(buffer)
    position = start
    while position < end:
        count = os.preadv(fd, [view[: min(len(view), end - position)]], position)
        if count <= 0:
            raise LocalError(f"file ended at byte {position} while hashing up to {end}")
        hasher.update(view[:count])
        position += count


def start_writeback(fd: int, start: int, end: int) -> None:
    """Start writing bytes ``[start, end)`` of ``fd`` to disk, and return without waiting for
    the disk (``sync_file_range``; where there is none, ``fdatasync``, which waits): a later
    fsync then has little left to write."""
    if end <= start:
        return
    if _SYNC_FILE_RANGE is None or _SYNC_FILE_RANGE(fd, start, end - start, _START_WRITE) != 0:
        os.fdatasync(fd)


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _sync_file_range()
#: SYNC_FILE_RANGE_WRITE: start writing the range's dirty pages; wait for nothing else.
_START_WRITE = 2
