"""The optional C kernel for streamed passes (``kernel.c``), once a shell installs it.

A weighted combination followed by the exact float64 distances of every input to it is
memory-bound; in torch it takes a dozen passes over cache-sized spans (the float64 squares
alone are written, squared and halved), in C one pass while each slice is in L1. The kernel
gives the same bits as the torch code (:func:`p2ptrain.aggregate.rules_basic.stream_pass`),
and the tests compare the two on every shape class, so a machine without the kernel only
runs slower, never differently.

This package builds nothing and reads no environment: a shell installs a loader with
:func:`install_kernel` (:func:`p2ptrain.store.kernel_build.ensure_kernel` compiles
``kernel.c`` with the system C compiler into a cache). The loader is called once, on the
first pass that could use the kernel; until a loader is installed, or when it returns None,
every pass takes the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "KERNEL_SOURCE",
    "Int8Rows",
    "KernelLoader",
    "SecondMean",
    "Trimmed",
    "Weighted",
    "available",
    "dequantise_int8",
    "install_kernel",
    "installed_loader",
    "nesterov",
    "stream_pass",
    "tried",
]

#: The kernel's C source, shipped as package data; a shell compiles it.
KERNEL_SOURCE = Path(__file__).with_name("kernel.c")
#: Loads the compiled kernel, or returns None when it cannot (having said why).
KernelLoader = Callable[[], ctypes.CDLL | None]
#: The kernel's modes (``kernel.c``): aggregate given, weighted combination, trimmed mean.
_GIVEN, _WEIGHTED, _TRIMMED = 0, 1, 2
#: Values per slice of a kernel pass (the binary counter's width; the block's tree is then
#: halved down to the partial sums' width): wide slices cost less per value.
_WIDTH = 1024
#: Blocks per task when the pass is split between threads.
_BLOCKS_PER_TASK = 16

_loader: KernelLoader | None = None


def install_kernel(loader: KernelLoader | None) -> None:
    """Use the library ``loader`` returns (called once, on first use) for streamed passes;
    None goes back to the torch path. Installing again forgets the library loaded before."""
    global _loader  # noqa: PLW0603 - the one process-wide kernel, as a C library is
    _loader = loader
    _function.cache_clear()
    _dequantise.cache_clear()
    _nesterov.cache_clear()


def installed_loader() -> KernelLoader | None:
    """The loader :func:`install_kernel` installed, if any."""
    return _loader


@functools.cache
def _function() -> Any | None:
    library = None if _loader is None else _loader()
    if library is None:
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
        ctypes.c_int64,  # base
        ctypes.c_int64,  # block_begin
        ctypes.c_int64,  # block_end
        ctypes.c_int64,  # width
        ctypes.c_int64,  # tail
        ctypes.c_void_p,  # partial
        ctypes.c_int64,  # partial_blocks
        ctypes.c_int64,  # products
        ctypes.c_void_p,  # squares
        ctypes.c_int64,  # second_trim
        ctypes.c_void_p,  # second
        ctypes.c_void_p,  # second_partial
        ctypes.c_void_p,  # codes
        ctypes.c_void_p,  # code_status
    ]
    return function


class _Codes(ctypes.Structure):
    """The kernel's ``p2p_codes``."""

    _fields_ = (
        ("rows", ctypes.c_int64),
        ("segments", ctypes.c_int64),
        ("starts", ctypes.c_void_p),
        ("block_size", ctypes.c_int64),
        ("q", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
    )


@functools.cache
def _dequantise() -> Any | None:
    library = None if _loader is None else _loader()
    if library is None:
        return None
    function = library.p2p_dequantise_int8
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_void_p,  # q
        ctypes.c_void_p,  # scale
        ctypes.c_int64,  # n
        ctypes.c_int64,  # block_size
        ctypes.c_int64,  # lead
        ctypes.c_void_p,  # out
    ]
    return function


@functools.cache
def _nesterov() -> Any | None:
    library = None if _loader is None else _loader()
    if library is None:
        return None
    function = library.p2p_nesterov
    function.restype = None
    function.argtypes = [
        ctypes.c_void_p,  # theta
        ctypes.c_void_p,  # g
        ctypes.c_void_p,  # old
        ctypes.c_int64,  # n
        ctypes.c_float,  # mu
        ctypes.c_float,  # lr
        ctypes.c_void_p,  # new_theta
        ctypes.c_void_p,  # new_buf
    ]
    return function


#: Values per task of a threaded outer step.
_STEP_TASK = 1 << 18


def nesterov(
    theta: torch.Tensor,
    g: torch.Tensor,
    old: torch.Tensor | None,
    *,
    mu: float,
    lr: float,
    new_theta: torch.Tensor,
    new_buf: torch.Tensor,
) -> bool:
    """One Nesterov outer step of flat tensors by the kernel (``mu`` and ``lr`` already
    float32 values), the bits of ``outer.OuterNesterov``; on as many threads as torch may
    use. False, touching nothing, when the kernel is unavailable or a tensor does not fit."""
    function = _function() and _nesterov()
    if function is None:
        return False
    tensors = [theta, g, new_theta, new_buf] + ([] if old is None else [old])
    n = theta.numel()
    if any(not _usable(t) or t.dim() != 1 or t.numel() != n for t in tensors):
        return False

    def run(first: int) -> None:
        last = min(first + _STEP_TASK, n)

        def at(t: torch.Tensor) -> int:
            return int(t.data_ptr()) + 4 * first

        function(
            at(theta), at(g), None if old is None else at(old), last - first, mu, lr,
            at(new_theta), at(new_buf),
        )  # fmt: skip

    threads = max(1, torch.get_num_threads())
    starts = range(0, n, _STEP_TASK)
    if threads == 1 or len(starts) == 1:
        for first in starts:
            run(first)
    else:
        list(_pool(threads).map(run, starts))
    return True


def dequantise_int8(
    q: torch.Tensor, scale: torch.Tensor, block_size: int, lead: int, out: torch.Tensor
) -> int | None:
    """``out[j] = q[j] * scale[(lead + j) // block_size]`` (the int8 codec's decode, the same
    bits) by the kernel: 0 (every value written is finite), or 1 when a code is -128, or 2
    when a scale is negative or not finite, or 3 when a value overflows to infinity; None
    (nothing done) when the kernel is unavailable or a tensor does not fit."""
    function = _function() and _dequantise()
    if function is None:
        return None
    fits = (
        q.dtype == torch.int8
        and scale.dtype == torch.float32
        and out.dtype == torch.float32
        and all(t.is_contiguous() and t.device.type == "cpu" for t in (q, scale, out))
        and q.numel() == out.numel()
        and scale.numel() >= (lead + q.numel() - 1) // block_size + 1
    )
    if not fits:
        return None
    return int(
        function(q.data_ptr(), scale.data_ptr(), q.numel(), block_size, lead, out.data_ptr())
    )


def tried() -> bool:
    """Whether the installed loader was called already (by a pass, or :func:`available`)."""
    return _loader is not None and _function.cache_info().currsize > 0


def available() -> bool:
    """Whether a kernel is installed and loads (loading it on first call)."""
    return _function() is not None


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


@dataclass(frozen=True, slots=True)
class SecondMean:
    """With a :class:`Trimmed` pass, from the same sort: the mean of ranks ``trim .. n - 1 -
    trim`` (the network must decide them) into ``out`` (a span like the aggregate), the drops
    counted for this ``trim``, and each row's squared distances to it (float64 trees, shaped
    like ``partial``) into ``partial``."""

    trim: int
    out: torch.Tensor
    partial: torch.Tensor


@dataclass(frozen=True, slots=True)
class Int8Rows:
    """The first ``len(q)`` rows of a pass as int8 codes, decoded inside it (the int8
    codec's bits): parameter ``k`` holds positions ``starts[k] .. starts[k + 1] - 1`` (each
    non-empty, ``starts[0] = 0``, ``starts[-1]`` the vectors' length); ``q[i][k]`` and
    ``scale[i][k]`` are the addresses of row ``i``'s codes and scales of parameter ``k``,
    which the caller keeps mapped (and checked in bounds) for the pass. After the pass,
    ``status`` (int32, one per row) holds each row's worst decode status
    (:func:`dequantise_int8`'s): a row with one but 0 made the pass meaningless."""

    starts: Sequence[int]
    block_size: int
    q: Sequence[Sequence[int]]
    scale: Sequence[Sequence[int]]
    status: torch.Tensor


def _codes_args(codes: Int8Rows | None) -> tuple[Any, list[Any]] | None:
    """The kernel's ``codes`` struct (and what it points at, kept alive by the caller)."""
    if codes is None:
        return None
    rows, segments = len(codes.q), len(codes.starts) - 1
    if segments < 1 or codes.block_size < 1 or len(codes.scale) != rows:
        raise ValueError("int8 rows need one or more parameters and a positive block size")
    if any(len(q) != segments for q in codes.q) or any(len(s) != segments for s in codes.scale):
        raise ValueError("int8 rows need one address per parameter")
    if codes.status.dtype != torch.int32 or codes.status.numel() != rows:
        raise ValueError("int8 rows need an int32 status per row")
    starts = (ctypes.c_int64 * len(codes.starts))(*codes.starts)
    q = (ctypes.c_int64 * (rows * segments))(*[a for row in codes.q for a in row])
    scale = (ctypes.c_int64 * (rows * segments))(*[a for row in codes.scale for a in row])
    struct = _Codes(
        rows,
        segments,
        ctypes.cast(starts, ctypes.c_void_p),
        codes.block_size,
        ctypes.cast(q, ctypes.c_void_p),
        ctypes.cast(scale, ctypes.c_void_p),
    )
    return struct, [starts, q, scale]


def _combine_args(combine: Weighted | Trimmed | None) -> tuple[int, int, int, Any, Any, Any, int]:
    """The kernel's mode, n_combine, trim, combine_index, coefficients, pairs and n_pairs."""
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
    return mode, count, trim, c_index, c_coefficients, c_pairs, n_pairs


def _second_args(
    second: SecondMean | None,
    combine: Weighted | Trimmed | None,
    aggregate: torch.Tensor,
    partial: torch.Tensor | None,
) -> tuple[int, int | None, int | None] | None:
    """The kernel's ``second_trim``, ``second`` and ``second_partial``; None when ``second``
    does not fit the pass."""
    if second is None:
        return 0, None, None
    if not isinstance(combine, Trimmed) or partial is None or not _usable(second.out):
        return None
    if second.out.numel() != aggregate.numel() or second.partial.shape != partial.shape:
        return None
    if second.partial.dtype != torch.float64 or not second.partial.is_contiguous():
        return None
    if not 0 <= second.trim <= (combine.n - 1) // 2:
        return None
    return second.trim, second.out.data_ptr(), second.partial.data_ptr()


def stream_pass(
    rows: Sequence[torch.Tensor | None],
    combine: Weighted | Trimmed | None,
    aggregate: torch.Tensor,
    partial: torch.Tensor | None,
    chunk: int,
    *,
    blocks: tuple[int, int] | None = None,
    base: int = 0,
    length: int | None = None,
    products: bool = False,
    squares: torch.Tensor | None = None,
    second: SecondMean | None = None,
    codes: Int8Rows | None = None,
) -> bool:
    """Fill ``partial`` (float64, ``(len(rows), blocks, tail)``) with each row's per-block
    tree sums of squared distances to ``aggregate``, after writing into ``aggregate`` the
    ``combine`` aggregate when it is given (else ``aggregate`` is read); for the blocks
    ``blocks = (first, end)`` of ``chunk`` values, default all of them. None rows stand
    for the zero vector; ``partial`` None asks for the ``combine`` aggregate alone. ``rows``
    and ``aggregate`` may be spans of the vectors, starting at
    position ``base`` of vectors of ``length`` values (default: they are whole). With
    ``products``, the sums are of each row's products with the aggregate (float32 x float32,
    exact in float64; a row that is the aggregate's own span gives its squared norm).
    ``squares`` (float64, shaped like ``partial``) gets each row's sums of its own squares
    (its squared norm's tree) in the same pass; ``second`` (with a :class:`Trimmed`
    ``combine`` and ``partial``) a second mean from the same sort. ``codes``: the first
    rows are decoded from int8 codes inside the pass (their entries in ``rows`` are None,
    and do not stand for zeros). Returns False, touching
    nothing, when the kernel is unavailable or a tensor is not a contiguous CPU float32 one."""
    function = _function()
    if function is None or not _usable(aggregate):
        return False
    if any(row is not None and not _usable(row) for row in rows):
        return False
    code_rows = 0 if codes is None else len(codes.q)
    if code_rows > len(rows) or any(row is not None for row in rows[:code_rows]):
        return False
    length = aggregate.numel() if length is None else length
    if partial is None:
        if combine is None:
            return False
        n_rows, partial_blocks, tail, partial_pointer = len(rows), 0, _WIDTH, None
    else:
        n_rows, partial_blocks, tail = partial.shape
        if partial.dtype != torch.float64 or not partial.is_contiguous() or chunk % tail:
            return False
        if chunk < _WIDTH or tail > _WIDTH:
            return False
        partial_pointer = partial.data_ptr()
    squares_pointer = None
    if squares is not None:
        if partial is None or squares.shape != partial.shape:
            return False
        if squares.dtype != torch.float64 or not squares.is_contiguous():
            return False
        squares_pointer = squares.data_ptr()
    if isinstance(combine, Trimmed) and any(row is None for row in rows[code_rows : combine.n]):
        return False
    second_args = _second_args(second, combine, aggregate, partial)
    if second_args is None:
        return False
    second_trim, second_pointer, second_partial = second_args
    pointers = (ctypes.c_void_p * len(rows))(*[None if r is None else r.data_ptr() for r in rows])
    mode, count, trim, c_index, c_coefficients, c_pairs, n_pairs = _combine_args(combine)
    first, last = (0, -(-length // chunk)) if blocks is None else blocks
    threads = max(1, torch.get_num_threads())
    per_task = max(1, min(_BLOCKS_PER_TASK, -(-(last - first) // threads)))
    starts = range(first, last, per_task)
    dropped = torch.zeros(len(starts), max(1, count), dtype=torch.int64)
    decoding = _codes_args(codes)
    codes_pointer = None if decoding is None else ctypes.addressof(decoding[0])
    status = torch.zeros(len(starts), max(1, code_rows), dtype=torch.int32)

    def run(task: int) -> int:
        begin = starts[task]
        return int(
            function(
                pointers, n_rows, mode, c_index, c_coefficients, count, c_pairs, n_pairs, trim,
                dropped[task].data_ptr(), aggregate.data_ptr(), length, base,
                begin, min(begin + per_task, last), _WIDTH, tail, partial_pointer, partial_blocks,
                int(products), squares_pointer, second_trim, second_pointer, second_partial,
                codes_pointer, status[task].data_ptr(),
            )
        )  # fmt: skip

    if threads == 1 or len(starts) == 1:
        results = [run(task) for task in range(len(starts))]
    else:
        results = list(_pool(threads).map(run, range(len(starts))))
    if any(results):
        raise MemoryError("the aggregation kernel could not allocate its scratch memory")
    if isinstance(combine, Trimmed):
        combine.dropped.add_(dropped.sum(dim=0)[: combine.n])
    if codes is not None:
        torch.maximum(codes.status, status.amax(dim=0)[:code_rows], out=codes.status)
    return True
