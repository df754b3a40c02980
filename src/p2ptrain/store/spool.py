"""Blobs spooled to files while they are computed (:mod:`p2ptrain.core.spool`).

A :class:`FileSpool` opens each blob as a new file in its directory (a blob store's ``tmp/``,
so a store adopts the file by renaming it: :meth:`~p2ptrain.store.blobs.BlobStore.adopt`).
The writer fills it by offset with ``os.pwrite``; closing it gives a :class:`SpooledFile`:
the file, read by range, hashed once on first use, and mapped into memory when its tensors
are asked for. A spooled file nobody adopted is deleted when its last user drops it (and a
crash leaves it in ``tmp/``, which the store clears when it next opens alone).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import mmap
import os
import queue
import threading
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from p2ptrain.core.spool import BlobSink
from p2ptrain.core.tensors import DEFAULT_MAX_BYTES, read_layout
from p2ptrain.store.blob_io import FileMapping

__all__ = ["FileSpool", "SpooledFile"]

#: Bytes hashed per read when a spooled file's id is computed.
_HASH_READ = 1 << 24


def _discard(fd: int, path: list[str | None]) -> None:
    os.close(fd)
    if path[0] is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path[0])


class _Hasher:
    """Hashes the ranges a writer wrote, in order, on a thread of its own (reading them
    from the page cache through a mapping of the file: no copy, and each range's pages let
    go once hashed), so the id is ready soon after the last write."""

    def __init__(self, fd: int, size: int) -> None:
        self._mapping, self._digest = FileMapping(fd, size), hashlib.sha256()
        self._ranges: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="p2ptrain-spool-hash", daemon=True)
        self._failure: OSError | None = None
        self._thread.start()

    def add(self, offset: int, length: int) -> None:
        self._ranges.put((offset, length))

    def hexdigest(self) -> str:
        self._ranges.put(None)
        self._thread.join()
        self._mapping.close()
        if self._failure is not None:
            raise self._failure
        return self._digest.hexdigest()

    def _run(self) -> None:
        while (item := self._ranges.get()) is not None:
            if self._failure is not None:
                continue
            offset, length = item
            try:
                memory = self._mapping.memory()
                if memory is None:
                    continue  # an empty file
                with memory:
                    for start in range(offset, offset + length, _HASH_READ):
                        size = min(_HASH_READ, offset + length - start)
                        self._digest.update(memory[start : start + size])
                        self._mapping.forget(start, size)
            except (OSError, ValueError) as exc:
                self._failure = OSError(f"a spooled file could not be hashed: {exc}")


def _pread_exactly(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:  # a short read (rare on regular files)
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise OSError(f"a spooled file ended at byte {offset + len(data)}")
        data += more
    return data


class SpooledFile:
    """A finished blob in a file (see the module docstring). Reads use the open file, so
    they work wherever a store moved it."""

    def __init__(
        self, fd: int, path: str, size: int, hashed: Callable[[], str] | None = None
    ) -> None:
        self._fd, self._size = fd, size
        self._path: list[str | None] = [path]  # None once a store owns the file
        self._where = path
        self._hashed = hashed
        self._closer = weakref.finalize(self, _discard, fd, self._path)
        self._mapping = FileMapping(fd, size)

    def __len__(self) -> int:
        return self._size

    @property
    def path(self) -> str:
        return self._where

    @functools.cached_property
    def blob_id(self) -> str:
        if self._hashed is not None:
            return self._hashed()
        digest = hashlib.sha256()
        for offset in range(0, self._size, _HASH_READ):
            digest.update(self.read(offset, min(_HASH_READ, self._size - offset)))
        return digest.hexdigest()

    @property
    def verified_id(self) -> str:
        return self.blob_id

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self._size:
            raise OSError(f"bytes {offset}..{offset + length} lie outside {self._where}")
        return _pread_exactly(self._fd, length, offset)

    def memory(self) -> memoryview | None:
        return self._mapping.memory()

    def forget(self, offset: int, length: int) -> None:
        self._mapping.forget(offset, length)

    def tensors(self) -> dict[str, torch.Tensor]:
        layout = read_layout(self.read, self._size, max_bytes=max(self._size, DEFAULT_MAX_BYTES))
        # a private mapping: writable views (torch wants them), pages read from the file
        mapped = mmap.mmap(self._fd, self._size, access=mmap.ACCESS_COPY) if self._size else None
        out: dict[str, torch.Tensor] = {}
        for name, slot in layout.slots.items():
            count = slot.end - slot.begin
            if mapped is None or count == 0:
                out[name] = torch.empty(slot.shape, dtype=slot.dtype)
                continue
            flat = torch.frombuffer(
                mapped,
                dtype=slot.dtype,
                offset=layout.data_start + slot.begin,
                count=count // slot.dtype.itemsize,
            )
            out[name] = flat.view(slot.shape)
        return out

    def adopted(self, path: str) -> None:
        self._path[0] = None
        self._where = path


class _FileSink:
    def __init__(self, directory: Path, size: int) -> None:
        path = directory / f"spool-{uuid.uuid4().hex}"
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._path, self._size = str(path), size
        # a sink dropped unfinished (the reduction failed) takes its file with it
        self._owner = weakref.finalize(self, _discard, self._fd, [self._path])
        os.ftruncate(self._fd, size)
        # written front to back (as a reduction writes), the file is hashed as it grows
        self._hasher: _Hasher | None = None
        self._written = 0

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > self._size:
            raise ValueError(f"{len(view)} bytes at {offset} do not fit a {self._size}-byte blob")
        start, length = offset, len(view)
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written
        if start == self._written >= 0:
            if self._hasher is None and start == 0:
                self._hasher = _Hasher(self._fd, self._size)
            if self._hasher is not None:
                self._hasher.add(start, length)
            self._written += length
        else:
            self._written = -1  # out of order: the id is hashed from the file when asked

    def close(self) -> SpooledFile:
        self._owner.detach()
        hasher = self._hasher
        in_order = hasher is not None and self._written == self._size
        hashed = hasher.hexdigest if in_order and hasher is not None else None
        if hasher is not None and not in_order:
            hasher.hexdigest()  # let its thread end
        return SpooledFile(self._fd, self._path, self._size, hashed)


class FileSpool:
    """Spools each blob to a new file in ``directory`` (created if missing)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._directory = Path(directory)
        self._directory.mkdir(parents=True, exist_ok=True)

    def open(self, size: int) -> BlobSink:
        return _FileSink(self._directory, size)
