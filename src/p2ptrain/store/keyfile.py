"""A node's data directory and the identity key in it (mode 0600).

Layout (DESIGN §6)::

    DIR/identity.key   Ed25519 private key, PKCS#8 PEM, mode 0600
    DIR/blobs/         content-addressed blobs
    DIR/node.db        SQLite state (WAL)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from p2ptrain.core.identity import Identity
from p2ptrain.errors import LocalError

IDENTITY_FILE = "identity.key"


def identity_path(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / IDENTITY_FILE


def create_identity(data_dir: str | os.PathLike[str]) -> Identity:
    """Create ``data_dir`` (if needed) with a new identity; never overwrite an existing one."""
    directory = Path(data_dir)
    path = identity_path(directory)
    if path.exists():
        raise LocalError(
            f"{path} already holds an identity; p2ptrain never overwrites a key. "
            "Use that data directory as it is, or choose another --dir."
        )
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        identity = Identity.generate()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise LocalError(f"{path} appeared while creating it; not overwriting it") from None
    except OSError as exc:
        raise LocalError(f"cannot create the identity in {directory}: {exc.strerror}") from exc
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, identity.to_pem())
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(directory)
    return identity


def load_identity(data_dir: str | os.PathLike[str]) -> Identity:
    """Load the identity of ``data_dir``; refuse a key file others can read."""
    path = identity_path(data_dir)
    try:
        mode = path.stat().st_mode
        pem = path.read_bytes()
    except FileNotFoundError:
        raise LocalError(
            f"no identity in {Path(data_dir)}; create one with `p2ptrain init --dir {data_dir}`"
        ) from None
    except OSError as exc:
        raise LocalError(f"cannot read {path}: {exc.strerror}") from exc
    if stat.S_IMODE(mode) & 0o077:
        raise LocalError(
            f"{path} is readable by other users (mode {stat.S_IMODE(mode):o}); "
            f"run `chmod 600 {path}` and consider the key exposed"
        )
    return Identity.from_pem(pem)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
