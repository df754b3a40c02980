"""Bit-exact arithmetic for canonical aggregation (DESIGN §1, principle 3).

Two honest validators on different machines must produce the same bytes, so nothing here
may depend on thread count, SIMD width or input order:

* **Elementwise work** (``mul``, ``add``, ``sub``, ``div``, ``minimum``, ``maximum``, ``sort``
  along the update axis) is exact per element: IEEE-754 rounds each operation correctly, and
  torch computes each output element independently, whatever the vector width or threads.
  Multiply and add are always separate calls -- never ``addcmul``/``add(alpha=...)``, which
  may be fused into one FMA rounding on some machines.
* **Reductions that feed a decision** (norms, dot products, distances) are accumulated in
  float64 by :func:`_reduce` (a difference is rounded once to float32, then squared
  exactly in float64): a pairwise tree whose shape depends only on the length,
  built from elementwise adds. torch's own ``sum`` splits work by thread count and vector
  width, so its last bits can differ between machines; it is never used for a decision.
  A float32 x float32 product is exact in float64, so dot products only round in the sum.
* **Updates are processed in a fixed order**: sorted by update id (the caller sorts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from p2ptrain.errors import LocalError

#: Elements per chunk for streamed elementwise work; small enough to stay in cache.
CHUNK = 1 << 16

Tensors = Mapping[str, torch.Tensor]


def _halve_to_one(work: torch.Tensor) -> float:
    """Pairwise-sum a power-of-two float64 buffer in place: ``x[:h] += x[h:]`` until one
    value is left. Each step is elementwise, so the result is the same on every machine."""
    size = work.numel()
    while size > 1:
        size //= 2
        torch.add(work[:size], work[size : 2 * size], out=work[:size])
    return float(work[0])


def _reduce(n: int, fill: Callable[[int, int, torch.Tensor], None]) -> float:
    """Sum ``n`` float64 terms in a fixed order that depends only on ``n``.

    The terms are produced chunk by chunk (``fill(start, end, out)`` writes terms
    ``start..end`` into ``out``); each chunk of :data:`CHUNK` terms (zero-padded) is summed
    by a pairwise tree, then the chunk sums by another (zero-padded to a power of two).
    """
    if n == 0:
        return 0.0
    chunks = (n + CHUNK - 1) // CHUNK
    if chunks == 1:
        width = 1 << (n - 1).bit_length()
        buffer = torch.zeros(width, dtype=torch.float64)
        fill(0, n, buffer[:n])
        return _halve_to_one(buffer)
    partial = torch.zeros(1 << (chunks - 1).bit_length(), dtype=torch.float64)
    buffer = torch.empty(CHUNK, dtype=torch.float64)
    for index in range(chunks):
        start = index * CHUNK
        end = min(start + CHUNK, n)
        if end - start < CHUNK:
            buffer.zero_()
        fill(start, end, buffer[: end - start])
        partial[index] = _halve_to_one(buffer)
    return _halve_to_one(partial)


def dot64(a: torch.Tensor, b: torch.Tensor) -> float:
    """Reproducible dot product of two float32 vectors; float32 x float32 products are exact
    in float64, so only the fixed-order sum rounds."""
    _same_length(a, b)

    def fill(start: int, end: int, out: torch.Tensor) -> None:
        out.copy_(a[start:end])
        out.mul_(b[start:end])

    return _reduce(a.numel(), fill)


def sqnorm64(a: torch.Tensor) -> float:
    """Reproducible squared L2 norm, accumulated in float64."""

    def fill(start: int, end: int, out: torch.Tensor) -> None:
        out.copy_(a[start:end])
        out.mul_(out)

    return _reduce(a.numel(), fill)


def sqdist64(a: torch.Tensor, b: torch.Tensor) -> float:
    """Reproducible squared L2 distance of two float32 vectors: each difference is rounded
    to float32 (one correctly rounded operation, so the same everywhere), squared exactly in
    float64, and summed in the fixed tree order. Symmetric: ``fl(a - b) = -fl(b - a)``."""
    _same_length(a, b)

    def fill(start: int, end: int, out: torch.Tensor) -> None:
        torch.sub(a[start:end], b[start:end], out=out)  # float32 difference, widened
        out.mul_(out)

    return _reduce(a.numel(), fill)


def all_finite(a: torch.Tensor) -> bool:
    """Whether every value of ``a`` is finite: exactly ``isfinite(a).all()``, in one fast
    pass where it holds. A sum with an infinity or a NaN among its terms is not finite,
    whatever the order it is added in, so a finite sum proves every term finite; a sum that
    is not (finite terms can overflow) is decided value by value."""
    if math.isfinite(float(a.sum())):
        return True
    return bool(torch.isfinite(a).all())


def norm64(a: torch.Tensor) -> float:
    return math.sqrt(sqnorm64(a))


def _same_length(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.numel() != b.numel():
        raise LocalError(f"vectors differ in length: {a.numel()} and {b.numel()}")


def flatten(tensors: Tensors, names: Sequence[str] | None = None) -> torch.Tensor:
    """Concatenate float32 tensors in sorted-name order (or ``names``) into one vector."""
    order = sorted(tensors) if names is None else names
    parts = [tensors[name].reshape(-1) for name in order]
    if not parts:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat(parts)


def unflatten(vector: torch.Tensor, like: Tensors, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """Split a vector made by :func:`flatten` back into tensors shaped like ``like`` (views
    of ``vector`` with ``copy=False``)."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name in sorted(like):
        count = like[name].numel()
        view = vector[offset : offset + count].reshape(like[name].shape)
        out[name] = view.clone() if copy else view
        offset += count
    if offset != vector.numel():
        raise LocalError(f"vector has {vector.numel()} values, the tensors hold {offset}")
    return out
