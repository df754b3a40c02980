"""Local storage faults: a full, read-only or failing disk, reported once and recovered from.

A write the disk refuses (blobs, the database, the status file) is not the role's failure
and not a peer's: the node says so once -- in the log, in ``p2ptrain status`` and its
``--json`` -- with the path and what to do, keeps running at the height it has, and tries
again as its steps come round (a fetch backs off as after any transport fault). The first
write that succeeds again clears the report; nothing was lost (what was not written is
fetched or computed again).
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import time

from p2ptrain.errors import StorageFault
from p2ptrain.observe.status import StorageProblem

__all__ = ["StorageHealth", "as_storage_fault"]

logger = logging.getLogger(__name__)

#: OS errors that mean the disk, not the program, refused a write.
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})
_SQLITE_DISK_WORDS = ("disk is full", "readonly", "read-only", "disk i/o error")


def as_storage_fault(
    error: BaseException, where: str = "the data directory"
) -> StorageFault | None:
    """``error`` (or what caused it) as a storage fault, or None if it is something else;
    ``where`` names the place when the error does not (a write() has no file name)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, StorageFault):
            return current
        if isinstance(current, OSError) and current.errno in _DISK_ERRNOS:
            path = current.filename if isinstance(current.filename, str) else where
            return StorageFault(path, current.strerror or str(current))
        if isinstance(current, sqlite3.OperationalError):
            text = str(current).lower()
            if any(word in text for word in _SQLITE_DISK_WORDS):
                return StorageFault(f"the node database in {where}", str(current))
        current = current.__cause__ or current.__context__
    return None


class StorageHealth:
    """Whether the node's writes go through; the current problem, reported once."""

    def __init__(self, data_dir: str = "the data directory") -> None:
        self.data_dir = data_dir
        self.problem: StorageProblem | None = None
        self._failures = 0

    def check(self, where: str, error: BaseException) -> bool:
        """If ``error`` is a storage fault, record it (logged once) and return True."""
        fault = as_storage_fault(error, self.data_dir)
        if fault is None:
            return False
        self._failures += 1
        if self.problem is None:
            logger.warning("%s: %s", where, fault)
            self.problem = StorageProblem(
                path=fault.path, message=str(fault), since=time.time(), failures=1
            )
        else:
            logger.debug("%s: %s (still)", where, fault)
            self.problem = StorageProblem(
                path=self.problem.path,
                message=self.problem.message,
                since=self.problem.since,
                failures=self._failures,
            )
        return True

    def succeeded(self) -> None:
        """A write went through: the disk takes writes again."""
        if self.problem is not None:
            logger.warning(
                "storage writable again (%d writes failed since the problem was reported); "
                "going on",
                self._failures,
            )
            self.problem, self._failures = None, 0
