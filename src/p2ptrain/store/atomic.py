"""Writing a whole file so that readers (and a crash) see the old bytes or the new, never part.

The bytes go to a temporary name in the same directory, are fsynced, and the temporary file
is renamed over the target (atomic on POSIX filesystems).
"""

from __future__ import annotations

import os
from pathlib import Path

from p2ptrain.errors import LocalError

__all__ = ["write_atomically"]


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``; a LocalError names the file when it cannot."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise LocalError(f"cannot write {path}: {exc.strerror}") from exc
