"""Building and caching the aggregation kernel (:mod:`p2ptrain.aggregate.native`).

``aggregate/`` only runs a kernel it is given; this shell compiles it. :func:`ensure_kernel`
installs :func:`load_kernel` as the kernel's loader; it is cheap and idempotent, and each
entry point that aggregates calls it (a node's ``serve``, the simulator, the benchmarks that
aggregate, the test suite), not the ``p2ptrain`` command for all its commands: this module
imports torch, which ``p2ptrain --version`` or ``status`` do without. Nothing is built until
the first streamed pass.

The library is compiled once per source and machine with the system C compiler (``$CC``,
else ``cc``) into ``$P2PTRAIN_CACHE`` (default ``$XDG_CACHE_HOME/p2ptrain``, else
``~/.cache/p2ptrain``); the build is written to a temporary name and renamed, so concurrent
processes are safe. ``P2PTRAIN_NATIVE=0`` disables the kernel. A failed build is logged
once (with the compiler's message) and the torch path is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from p2ptrain.aggregate import native

__all__ = ["ensure_kernel", "load_kernel"]

log = logging.getLogger(__name__)

#: Never -ffast-math or FMA contraction: each float operation must round exactly once.
_FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]


def ensure_kernel() -> None:
    """Let aggregation use the C kernel, built on first use, unless a loader is installed."""
    if native.installed_loader() is None:
        native.install_kernel(load_kernel)


def _cache_dir() -> Path:
    """Where built kernels are kept: ``$P2PTRAIN_CACHE``, else ``$XDG_CACHE_HOME/p2ptrain``,
    else ``~/.cache/p2ptrain``."""
    explicit = os.environ.get("P2PTRAIN_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "p2ptrain"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        command = [compiler, *_FLAGS, "-o", temporary, str(native.KERNEL_SOURCE)]
        completed = subprocess.run(command, capture_output=True, text=True, check=False)
        if completed.returncode != 0:
            raise OSError(
                f"{' '.join(command)} exited with {completed.returncode}: "
                f"{completed.stderr.strip()[-2000:]}"
            )
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def load_kernel() -> ctypes.CDLL | None:
    """The kernel library, compiled into the cache unless it is there already; None (with a
    warning that says why) when it is switched off or cannot be built."""
    if os.environ.get("P2PTRAIN_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning(
            "no C compiler found (set CC or install cc); aggregation uses the slower torch path"
        )
        return None
    source = native.KERNEL_SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [source, " ".join(_FLAGS).encode(), compiler.encode(), platform.machine().encode()]
        )
    ).hexdigest()[:24]
    suffix = ".dll" if sys.platform == "win32" else ".so"
    target = _cache_dir() / "native" / f"kernel-{key}{suffix}"
    try:
        if not target.exists():
            _build(compiler, target)
        return ctypes.CDLL(str(target))
    except OSError as error:
        log.warning(
            "could not build the aggregation kernel (%s); aggregation uses the slower torch "
            "path. Set P2PTRAIN_NATIVE=0 to skip the attempt.",
            error,
        )
        return None
