"""Low-level file I/O for the blob store: durable writes and hash-while-reading.

SHA-256 runs at about the speed of a page-cache copy, so for large blobs the hash is computed
on a second thread while this one writes or reads (hashlib and file I/O release the GIL).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

#: Below this size a second thread costs more than it saves.
PARALLEL_MIN_BYTES = 1 << 20
#: Reads hand the hashing thread one chunk at a time.
READ_CHUNK_BYTES = 8 << 20


def write_all(fd: int, view: memoryview) -> None:
    written = 0
    while written < view.nbytes:
        written += os.write(fd, view[written:])


def write_and_sync(fd: int, view: memoryview) -> None:
    write_all(fd, view)
    os.fsync(fd)


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems cannot fsync a directory
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def hash_while(view: memoryview, work: Callable[[], None]) -> str:
    """Run ``work`` on this thread while a second thread hashes ``view``; return the hash."""
    result: list[str] = []
    hasher = threading.Thread(
        target=lambda: result.append(hashlib.sha256(view).hexdigest()),
        name="blob-hash",
        daemon=True,
    )
    hasher.start()
    try:
        work()
    finally:
        hasher.join()
    return result[0]


def read_and_hash(fd: int, size: int) -> tuple[bytearray, str | None]:
    """Read ``size`` bytes from ``fd`` into a new buffer; return it and the SHA-256 hex of
    exactly those bytes (None if the file was shorter than ``size``).

    For large reads a second thread hashes each chunk as soon as it lands. ``bytearray(n)``
    comes from calloc, which maps fresh zero pages for large sizes, so the buffer costs no
    extra pass over memory.
    """
    data = bytearray(size)
    view = memoryview(data)
    hasher = hashlib.sha256()
    filled: queue.SimpleQueue[int] = queue.SimpleQueue()

    def hash_as_filled() -> None:
        start = 0
        while (end := filled.get()) > start:
            hasher.update(view[start:end])
            start = end

    parallel = size >= PARALLEL_MIN_BYTES
    thread = threading.Thread(target=hash_as_filled, name="blob-verify", daemon=True)
    if parallel:
        thread.start()
    position = 0
    try:
        while position < size:
            count = os.readv(fd, [view[position : position + READ_CHUNK_BYTES]])
            if count == 0:
                break
            position += count
            if parallel:
                filled.put(position)
    finally:
        if parallel:
            filled.put(-1)
            thread.join()
    if position != size:
        view.release()
        return bytearray(), None
    if not parallel:
        hasher.update(view)
    view.release()
    return data, hasher.hexdigest()


class FileMapping:
    """A stored file (which never changes: a new blob is a new file) mapped read-only on
    first use, for readers that want its bytes as memory."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd, self._size = fd, size
        self._mapped: mmap.mmap | None = None

    def memory(self) -> memoryview | None:
        """The whole file; None when it is empty (nothing to map)."""
        if self._size == 0:
            return None
        if self._mapped is None:
            self._mapped = mmap.mmap(self._fd, self._size, access=mmap.ACCESS_READ)
        return memoryview(self._mapped)

    def close(self) -> None:
        """Unmap the file, unless a view of :meth:`memory` is still held (then it goes with
        the last of them)."""
        if self._mapped is not None:
            with contextlib.suppress(BufferError):
                self._mapped.close()
            self._mapped = None

    def forget(self, offset: int, length: int) -> None:
        """Let go of the pages of bytes ``offset .. offset + length`` (they stay in the page
        cache, and come back if read again): a pass over a mapped cohort then holds a
        window of it in the process's memory, not all of it."""
        if self._mapped is None or length <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        end = min(self._size, offset + length)
        if end > start:
            self._mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
