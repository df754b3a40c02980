"""A directory that appears complete or not at all (used by ``data prepare``).

Everything is written, and fsynced, in a temporary sibling of the target,
``.{target.name}.preparing-<pid>-<random>`` (:func:`staging_directory`), and that is renamed
to the target at the end (:func:`install`): a reader, or a crash, sees the whole directory
or none. An existing target is replaced only when asked, and only when it is a prepared
dataset (it holds ``dataset.json``) or empty: it is renamed aside
(``.{target.name}.replaced-<pid>-<random>``), the new one renamed in, and the old removed.
The next run removes the siblings a killed run left (their process is gone), and puts a
dataset set aside back when a crash fell between the two renames and the target is missing.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from p2ptrain.errors import LocalError

__all__ = [
    "check_target",
    "fsync_directory",
    "install",
    "remove_stale",
    "staging_directory",
    "write_synced",
]

_MARKS = ("preparing", "replaced")


def check_target(target: Path, overwrite: bool) -> None:
    """LocalError unless ``target`` is free, or may be replaced (see the module docstring)."""
    if not os.path.lexists(target):
        return
    if not overwrite:
        raise LocalError(
            f"{target} exists; pass --overwrite to replace it (the old dataset stays until "
            "the new one is complete), or choose another --out"
        )
    if not target.is_dir() or not (
        (target / "dataset.json").is_file() or not any(target.iterdir())
    ):
        raise LocalError(
            f"{target} exists and is not a prepared dataset (it has no dataset.json); "
            "p2ptrain will not replace it: remove it yourself or choose another --out"
        )


def install(temporary: Path, target: Path, overwrite: bool) -> None:
    """Rename the finished ``temporary`` to ``target`` (replacing an old one if
    ``overwrite``)."""
    try:
        if os.path.lexists(target):
            if not overwrite:
                raise LocalError(f"{target} appeared while preparing; not replacing it")
            old = target.parent / f".{target.name}.replaced-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(target, old)
            try:
                os.rename(temporary, target)
            except OSError:
                os.rename(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(temporary, target)
        fsync_directory(target.parent)
    except OSError as exc:
        raise LocalError(f"cannot move the prepared dataset to {target}: {exc.strerror}") from exc


def write_synced(path: Path, data: bytes) -> None:
    """A new file holding ``data``, on disk when this returns."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def remove_stale(target: Path) -> list[Path]:
    """Remove the temporary siblings of ``target`` left by prepares whose process is gone
    (a dataset set aside by an interrupted overwrite goes back to ``target`` when that is
    missing); returns what was removed."""
    removed = []
    prefix = f".{target.name}."
    for entry in sorted(target.parent.iterdir()):
        mark, _, rest = entry.name.removeprefix(prefix).partition("-")
        pid = rest.partition("-")[0]
        if not entry.name.startswith(prefix) or mark not in _MARKS or not pid.isdigit():
            continue
        if _alive(int(pid)):
            continue
        if mark == "replaced" and not os.path.lexists(target):
            os.rename(entry, target)
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def staging_directory(target: Path) -> Path:
    """A new, empty temporary sibling of ``target`` (after removing stale ones)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(target)
        temporary = target.parent / f".{target.name}.preparing-{os.getpid()}-{secrets.token_hex(4)}"
        temporary.mkdir()
    except OSError as exc:
        raise LocalError(f"cannot create {target}: {exc.strerror}") from exc
    return temporary
