"""Writing a whole file so that readers (and a crash) see the old bytes or the new, never part.

The bytes go to a temporary name in the same directory, are fsynced, and the temporary file
is renamed over the target (atomic on POSIX filesystems). Files that are only reports,
rewritten every few seconds (a node's status, its window history), skip the fsync
(``durable=False``): readers still see the old bytes or the new, and a power loss may leave
such a file empty until the node writes it again, but no write waits on the disk, where an
fsync behind other processes' writes can take a third of a second.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from p2ptrain.errors import LocalError

__all__ = ["replace_atomically", "write_atomically"]


def write_atomically(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data``; a LocalError names the file when it cannot.
    ``durable=False``: no fsync (a report; see the module docstring)."""

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as handle:
            handle.write(data)

    replace_atomically(path, write, durable=durable)


def replace_atomically(path: Path, write: Callable[[Path], None], *, durable: bool = True) -> None:
    """Replace ``path`` with the file ``write`` writes at the temporary path it is given
    (a writer that streams, e.g. ``safetensors.torch.save_file``, never holds the whole
    file in memory); a LocalError names the file when it cannot."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temporary)
        if durable:
            with open(temporary, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise LocalError(f"cannot write {path}: {exc.strerror}") from exc


def overwrite_in_place(path: Path, data: bytes) -> None:
    """Write ``data`` over the start of ``path`` when it fits in the file's current size
    (blocks it holds already: a full disk can still take it), blanking the rest with
    spaces. Raises OSError when the file is missing or too small."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if len(data) > size:
            raise OSError(errno.ENOSPC, "the new contents do not fit in place", str(path))
        view = memoryview(data + b" " * (size - len(data)))
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], written)
    finally:
        os.close(fd)
