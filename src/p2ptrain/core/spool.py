"""Where a blob is written while it is computed: in memory, or spooled to a file.

A reduction writes blobs as large as the model (the next weights, the optimizer state, the
aggregate). Held in memory, a validator holds each of them on top of the state it reduces
from; spooled to a file, they cost page cache, which the kernel can write back and drop,
instead of the process's memory. Whoever runs a reduction chooses: a :class:`BlobSpool`
opens a :class:`BlobSink` of a known size, the writer fills it by offset, and
:meth:`BlobSink.close` gives the blob -- a ``bytearray`` (:class:`MemorySpool`) or a
:class:`SpooledBlob` (a file, see :class:`p2ptrain.store.spool.FileSpool`), which a blob
store adopts by renaming it, without copying or hashing it again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:  # a blob store reads this module without torch
    import torch

__all__ = ["Blob", "BlobSink", "BlobSpool", "MemorySpool", "SpooledBlob"]


@runtime_checkable
class SpooledBlob(Protocol):
    """A finished blob in a file: its size, any range of its bytes, its id (hashed once, on
    first use) and, for a state blob, its tensors as views of the file mapped into memory
    (pages are read as the tensors are)."""

    def __len__(self) -> int: ...

    @property
    def path(self) -> str:
        """Where the file is now (a store that adopts it moves it)."""
        ...

    @property
    def blob_id(self) -> str:
        """The SHA-256 of the bytes, hashed on first use."""
        ...

    @property
    def verified_id(self) -> str:
        """The same as :attr:`blob_id` (a :class:`~p2ptrain.aggregate.update_reader.ByteSource`)."""
        ...

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset``."""
        ...

    def memory(self) -> memoryview | None:
        """The whole blob mapped read-only (a
        :class:`~p2ptrain.aggregate.update_reader.ByteSource`); None when empty."""
        ...

    def forget(self, offset: int, length: int) -> None:
        """Let go of the mapped pages of that range (a ``ByteSource``)."""
        ...

    def tensors(self) -> dict[str, torch.Tensor]:
        """The blob decoded as a state dict whose tensors are views of the mapped file."""
        ...

    def adopted(self, path: str) -> None:
        """A store moved the file to ``path``: it is the store's now, never deleted here."""
        ...


#: A blob a spool produced: bytes in memory, or a file.
Blob: TypeAlias = bytes | bytearray | SpooledBlob


class BlobSink(Protocol):
    """A blob of a known size being written by offset."""

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` at ``offset`` (it must fit in the size the sink was opened with)."""
        ...

    def close(self) -> bytearray | SpooledBlob:
        """The finished blob (after this, the sink is not written to again)."""
        ...


class BlobSpool(Protocol):
    """Opens sinks for the blobs a computation writes."""

    def open(self, size: int) -> BlobSink:
        """A sink for a blob of ``size`` bytes (unwritten bytes are zero)."""
        ...


class _MemorySink:
    def __init__(self, size: int) -> None:
        self._data = bytearray(size)

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._data[offset : offset + len(view)] = view

    def close(self) -> bytearray:
        return self._data


class MemorySpool:
    """Blobs held in memory, as ``bytearray``."""

    def open(self, size: int) -> BlobSink:
        return _MemorySink(size)
