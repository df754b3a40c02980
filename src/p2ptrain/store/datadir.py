"""A node's data directory: identity, blob store and state database together, and the lock
that gives the directory to one node for its whole life.

``DIR/node.lock`` is the lock: a running node holds an exclusive ``flock`` on it and has
written its pid in it. The kernel releases a ``flock`` when the file is closed or its process
ends in any way, SIGKILL included, so a crashed node never leaves a stale lock; the pid in
the file means something only while the lock is held. A ``flock`` belongs to the open file,
not to the process: a second :class:`DataDirLock` in the same process is refused too, and a
child forked without ``exec`` keeps the lock while it lives (the file is close-on-exec).
Readers (``p2ptrain status``, ``export``, tests) open a :class:`DataDir` without the lock.
"""

from __future__ import annotations

import fcntl
import os
import weakref
from pathlib import Path
from types import TracebackType

from p2ptrain.errors import DataDirInUse, LocalError
from p2ptrain.store.blobs import BlobStore
from p2ptrain.store.state import StateStore

__all__ = ["BLOBS_DIR", "LOCK_FILE", "STATE_DB", "DataDir", "DataDirLock", "check_not_in_use"]

BLOBS_DIR = "blobs"
STATE_DB = "node.db"
LOCK_FILE = "node.lock"
_PID_BYTES = 32


class DataDirLock:
    """This process's exclusive use of a data directory (created if needed), until
    :meth:`release`. Raises :class:`DataDirInUse` naming the holder's pid when another open
    lock holds it, and :class:`LocalError` when the directory cannot be created or written."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        _make_directory(self.path)
        lock_path = self.path / LOCK_FILE
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _cannot_write(self.path, exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _recorded_pid(fd)
            os.close(fd)
            raise DataDirInUse(str(self.path), pid) from None
        except OSError as exc:  # e.g. ENOLCK: a file system without locks
            os.close(fd)
            raise LocalError(
                f"cannot lock the data directory {self.path}: {exc.strerror}; put it on a "
                "local file system (--dir)"
            ) from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise _cannot_write(self.path, exc) from exc
        # Held as long as this object: release() or garbage collection closes the file.
        self._release = weakref.finalize(self, os.close, fd)

    @property
    def held(self) -> bool:
        return self._release.alive

    def release(self) -> None:
        """Give the directory up (closing the file drops the lock). Idempotent."""
        self._release()

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def check_not_in_use(path: str | os.PathLike[str]) -> None:
    """Raise :class:`DataDirInUse` if a node holds the data directory ``path``; a path that
    is not a data directory (no lock file, not a directory) is not in use.

    A probe: it takes a shared lock and drops it at once, so a node starting on ``path``
    at that very instant would be refused."""
    lock_path = Path(path) / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise LocalError(f"cannot read the lock {lock_path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DataDirInUse(str(path), _recorded_pid(fd)) from None
    finally:
        os.close(fd)  # drops the shared lock, if we took it


def _make_directory(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise LocalError(
            f"cannot create the data directory {path}: {exc.strerror}; choose a directory "
            "this user can write (--dir)"
        ) from exc


def _cannot_write(path: Path, exc: OSError) -> LocalError:
    return LocalError(
        f"cannot write in the data directory {path}: {exc.strerror or exc}; choose a "
        "directory this user can write (--dir)"
    )


def _recorded_pid(fd: int) -> int | None:
    """The pid the holder wrote (None if it has not yet, or the file holds something else)."""
    try:
        text = os.pread(fd, _PID_BYTES, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


class DataDir:
    """Opens (creating if needed) the stores of one data directory; ``exclusive``: first
    take its :class:`DataDirLock`, held until :meth:`close` (what a running node does)."""

    def __init__(self, path: str | os.PathLike[str], *, exclusive: bool = False) -> None:
        self.path = Path(path)
        self.lock: DataDirLock | None = None
        if exclusive:
            self.lock = DataDirLock(self.path)
        else:
            _make_directory(self.path)
        try:
            self.blobs = BlobStore(self.path / BLOBS_DIR)
            try:
                self.state = StateStore(self.path / STATE_DB)
            except BaseException:
                self.blobs.close()
                raise
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise

    def close(self) -> None:
        self.state.close()
        self.blobs.close()
        if self.lock is not None:
            self.lock.release()

    def __enter__(self) -> DataDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
