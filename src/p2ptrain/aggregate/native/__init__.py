"""The optional C kernel for streamed passes (``kernel.c``), built on first use.

A weighted combination followed by the exact float64 distances of every input to it is
memory-bound; in torch it takes a dozen passes over cache-sized spans (the float64 squares
alone are written, squared and halved), in C one pass while each slice is in L1. The kernel
gives the same bits as the torch code (:func:`p2ptrain.aggregate.rules_basic.stream_pass`),
and the tests compare the two on every shape class, so a machine without a C compiler
only runs slower, never differently.

The library is compiled once per source and machine with the system C compiler (``$CC``,
else ``cc``) into ``$P2PTRAIN_CACHE`` (default ``$XDG_CACHE_HOME/p2ptrain``, else
``~/.cache/p2ptrain``); the build is written to a temporary name and renamed, so concurrent
processes are safe. ``P2PTRAIN_NATIVE=0`` disables the kernel. A failed build is logged
once (with the compiler's message) and the torch path is used.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["Trimmed", "Weighted", "available", "stream_pass"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("kernel.c")
#: Never -ffast-math or FMA contraction: each float operation must round exactly once.
_FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
#: The kernel's modes (``kernel.c``): aggregate given, weighted combination, trimmed mean.
_GIVEN, _WEIGHTED, _TRIMMED = 0, 1, 2
#: Blocks per task when the pass is split between threads.
_BLOCKS_PER_TASK = 16


def _cache_dir() -> Path:
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
        command = [compiler, *_FLAGS, "-o", temporary, str(_SOURCE)]
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


@functools.cache
def _library() -> Any | None:
    if os.environ.get("P2PTRAIN_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning(
            "no C compiler found (set CC or install cc); aggregation uses the slower torch path"
        )
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [source, " ".join(_FLAGS).encode(), compiler.encode(), platform.machine().encode()]
        )
    ).hexdigest()[:24]
    target = _cache_dir() / "native" / f"kernel-{key}{'.dll' if sys.platform == 'win32' else '.so'}"
    try:
        if not target.exists():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except OSError as error:
        log.warning(
            "could not build the aggregation kernel (%s); aggregation uses the slower torch "
            "path. Set P2PTRAIN_NATIVE=0 to skip the attempt.",
            error,
        )
        return None
    function = library.p2p_stream_pass
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),  # rows
        ctypes.c_int64,  # n_rows
        ctypes.c_int64,  # mode
        ctypes.POINTER(ctypes.c_int64),  # combine_index
        ctypes.POINTER(ctypes.c_float),  # coefficients
        ctypes.c_int64,  # n_combine
        ctypes.POINTER(ctypes.c_int64),  # pairs
        ctypes.c_int64,  # n_pairs
        ctypes.c_int64,  # trim
        ctypes.c_void_p,  # dropped
        ctypes.c_void_p,  # aggregate
        ctypes.c_int64,  # length
        ctypes.c_int64,  # block_begin
        ctypes.c_int64,  # block_end
        ctypes.c_int64,  # tail
        ctypes.c_void_p,  # partial
        ctypes.c_int64,  # partial_blocks
    ]
    return function


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first call)."""
    return _library() is not None


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="p2ptrain-kernel")


def _usable(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()


@dataclass(frozen=True, slots=True)
class Weighted:
    """The aggregate is ``sum c * rows[i]`` over ``(i, c)`` in ``terms``, in that order."""

    terms: Sequence[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class Trimmed:
    """The aggregate is the trimmed mean of rows ``0..n-1`` (``trim`` dropped per side,
    ranked by the comparators ``network``); ``dropped`` (int64, ``n``) gets the counts."""

    n: int
    trim: int
    network: Sequence[tuple[int, int]]
    dropped: torch.Tensor


def stream_pass(
    rows: Sequence[torch.Tensor | None],
    combine: Weighted | Trimmed | None,
    aggregate: torch.Tensor,
    partial: torch.Tensor,
    chunk: int,
    *,
    blocks: tuple[int, int] | None = None,
) -> bool:
    """Fill ``partial`` (float64, ``(len(rows), blocks, tail)``) with each row's per-block
    tree sums of squared distances to ``aggregate``, after writing into ``aggregate`` the
    ``combine`` aggregate when it is given (else ``aggregate`` is read); for the blocks
    ``blocks = (first, end)`` of ``chunk`` values, default all of them. None rows stand
    for the zero vector. Returns False, touching nothing, when the kernel is unavailable
    or a tensor is not a contiguous CPU float32 one."""
    function = _library()
    if function is None or not _usable(aggregate):
        return False
    if any(row is not None and not _usable(row) for row in rows):
        return False
    length = aggregate.numel()
    n_rows, partial_blocks, tail = partial.shape
    if partial.dtype != torch.float64 or not partial.is_contiguous() or chunk % tail:
        return False
    if isinstance(combine, Trimmed) and any(row is None for row in rows[: combine.n]):
        return False
    pointers = (ctypes.c_void_p * len(rows))(*[None if r is None else r.data_ptr() for r in rows])
    mode, index, coefficients, pairs, count, trim = _GIVEN, [0], [0.0], [0, 0], 0, 0
    if isinstance(combine, Weighted):
        mode, count = _WEIGHTED, len(combine.terms)
        index, coefficients = [i for i, _ in combine.terms], [c for _, c in combine.terms]
    elif isinstance(combine, Trimmed):
        mode, count, trim = _TRIMMED, combine.n, combine.trim
        pairs = [wire for pair in combine.network for wire in pair] or [0, 0]
    c_index = (ctypes.c_int64 * len(index))(*index)
    c_coefficients = (ctypes.c_float * len(coefficients))(*coefficients)
    c_pairs = (ctypes.c_int64 * len(pairs))(*pairs)
    n_pairs = len(pairs) // 2 if isinstance(combine, Trimmed) and combine.network else 0
    first, last = (0, -(-length // chunk)) if blocks is None else blocks
    threads = max(1, torch.get_num_threads())
    per_task = max(1, min(_BLOCKS_PER_TASK, -(-(last - first) // threads)))
    starts = range(first, last, per_task)
    dropped = torch.zeros(len(starts), max(1, count), dtype=torch.int64)

    def run(task: int) -> int:
        begin = starts[task]
        return int(
            function(
                pointers, n_rows, mode, c_index, c_coefficients, count, c_pairs, n_pairs, trim,
                dropped[task].data_ptr(), aggregate.data_ptr(), length,
                begin, min(begin + per_task, last), tail, partial.data_ptr(), partial_blocks,
            )
        )  # fmt: skip

    if threads == 1 or len(starts) == 1:
        codes = [run(task) for task in range(len(starts))]
    else:
        codes = list(_pool(threads).map(run, range(len(starts))))
    if any(codes):
        raise MemoryError("the aggregation kernel could not allocate its scratch memory")
    if isinstance(combine, Trimmed):
        combine.dropped.add_(dropped.sum(dim=0)[: combine.n])
    return True
