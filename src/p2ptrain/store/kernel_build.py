"""Loading, building and caching the aggregation kernel (:mod:`p2ptrain.aggregate.native`).

``aggregate/`` only runs a kernel it is given; this shell finds it. :func:`ensure_kernel`
installs :func:`load_kernel` as the kernel's loader; it is cheap and idempotent, and each
entry point that aggregates calls it (a node's ``serve``, the simulator, the benchmarks that
aggregate, the test suite), not the ``p2ptrain`` command for all its commands: this module
imports torch, which ``p2ptrain --version`` or ``status`` do without. Nothing is built until
the first streamed pass.

A wheel carries the kernel compiled at build time (``_kernel.so`` beside ``kernel.c``, see
setup.py): it is loaded from the package, and never compiled, when it was built from the
very source shipped beside it (its ``p2p_source_hash()`` is the SHA-256 of ``kernel.c``; an
editable install whose ``kernel.c`` changed since it was built gets a fresh build instead).
Otherwise the library is compiled once per source and machine with the system C compiler
(``$CC``,
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

__all__ = ["backend", "ensure_kernel", "load_kernel", "packaged_kernel"]

log = logging.getLogger(__name__)

#: Never -ffast-math or FMA contraction: each float operation must round exactly once.
_FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]


#: Where the loaded kernel came from ("packaged" or "built"); None until one loaded.
_origin: str | None = None
#: Why there is no kernel, once :func:`load_kernel` found none.
_missing: str | None = None


def backend() -> str | None:
    """The aggregation backend in use, in words, for the status and /metrics: ``native
    (packaged)``, ``native (built)`` or ``torch (…why)``; None until the first streamed pass
    asked for the kernel (a node that has not aggregated yet), or without a loader."""
    tried = native.tried()
    if not tried:
        return None
    if native.available():
        return f"native ({_origin or 'installed'})"
    return f"torch ({_missing or 'no kernel'})"


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


def packaged_kernel() -> ctypes.CDLL | None:
    """The kernel compiled into the package, if it is there and was built from the source
    shipped beside it."""
    suffix = ".dll" if sys.platform == "win32" else ".so"
    path = native.KERNEL_SOURCE.with_name(f"_kernel{suffix}")
    if not path.exists():
        return None
    try:
        library = ctypes.CDLL(str(path))
        stamp = library.p2p_source_hash
    except (OSError, AttributeError) as error:
        log.warning("the packaged aggregation kernel %s does not load: %s", path, error)
        return None
    stamp.restype = ctypes.c_char_p
    expected = hashlib.sha256(native.KERNEL_SOURCE.read_bytes()).hexdigest()
    if stamp() != expected.encode():
        log.info("the packaged aggregation kernel %s was built from another kernel.c", path)
        return None
    return library


def load_kernel() -> ctypes.CDLL | None:
    """The kernel library: the package's own, else compiled into the cache unless it is there
    already; None (with a warning that says why) when it is switched off or cannot be had."""
    global _origin, _missing  # noqa: PLW0603 - one kernel per process, as native's
    if os.environ.get("P2PTRAIN_NATIVE", "1") == "0":
        _missing = "P2PTRAIN_NATIVE=0"
        return None
    packaged = packaged_kernel()
    if packaged is not None:
        _origin = "packaged"
        return packaged
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        _missing = "no C compiler to build the kernel, and none in the package"
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
        library = ctypes.CDLL(str(target))
    except OSError as error:
        _missing = "the kernel did not build"
        log.warning(
            "could not build the aggregation kernel (%s); aggregation uses the slower torch "
            "path. Set P2PTRAIN_NATIVE=0 to skip the attempt.",
            error,
        )
        return None
    _origin = "built"
    return library
