"""The ``lowrank`` update codec: PowerSGD-style rank-r factors of each matrix.

A parameter with ``ndim >= 2`` is viewed as a matrix ``M`` of shape
``(rows, cols) = (shape[0], prod(shape[1:]))`` and, with ``r = min(rank, rows, cols)``, sent as
two float32 parts when the factors are smaller than the matrix (``(rows + cols) * r <
rows * cols``):

``p``   shape ``(rows, r)``
``q``   shape ``(cols, r)``

with ``M ~ p @ q.T``. Every other parameter (vectors, scalars, matrices too small to gain)
is sent raw as ``values`` (its own shape, float32).

**Encoding** (trainer side, deterministic for a given seed): one power iteration warm-started
from the previous round's ``q`` (seeded Gaussian at first): ``p = M q``, ``p`` orthonormalised
by QR, ``q = M.T p``. The encoder applies it to ``delta + residual`` (error feedback).

**Decoding** is bit-exact on every machine: no matmul. ``p @ q.T`` is the fixed-order sum of
rank-1 outer products ``p[:, k] * q[:, k]``, k = 0 .. r-1, each an elementwise broadcast
multiply, accumulated by separate elementwise adds.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from p2ptrain.core.tensors import TensorSpec
from p2ptrain.errors import LocalError

__all__ = ["MAX_RANK", "LowRankCodec", "reconstruct"]

MAX_RANK = 1024
"""Largest rank a manifest may ask for."""


def reconstruct(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``p @ q.T`` as a fixed-order sum of outer products: the same bits on every machine."""
    rows, rank = p.shape
    q_rows = q.t().contiguous()  # (rank, cols): each factor column as a contiguous row
    matrix = torch.empty(rows, q_rows.shape[1], dtype=torch.float32)
    torch.mul(p[:, 0:1], q_rows[0], out=matrix)
    term = torch.empty_like(matrix) if rank > 1 else matrix
    for k in range(1, rank):
        torch.mul(p[:, k : k + 1], q_rows[k], out=term)
        torch.add(matrix, term, out=matrix)
    return matrix


def _seed_for(seed: int, name: str) -> int:
    """A per-parameter generator seed, stable across processes and machines."""
    digest = hashlib.sha256(f"p2ptrain/lowrank/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class _PowerIteration:
    """One warm-started power iteration per call; keeps ``q`` for the next round."""

    def __init__(self, rows: int, cols: int, rank: int, seed: int) -> None:
        self._rows, self._cols, self._rank = rows, cols, rank
        self._generator = torch.Generator().manual_seed(seed)
        self._q = self._fresh_q()

    def _fresh_q(self) -> torch.Tensor:
        return torch.randn(self._cols, self._rank, generator=self._generator)

    def __call__(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        matrix = value.reshape(self._rows, self._cols)
        p = torch.linalg.qr(matrix @ self._q).Q
        q = matrix.t() @ p
        # A zero update leaves q zero, and a zero q would stay zero forever: start afresh.
        self._q = q if bool(q.any()) else self._fresh_q()
        return {"p": p.contiguous(), "q": q.contiguous()}


@dataclass(frozen=True, slots=True)
class LowRankCodec:
    """Rank-``rank`` factors of every matrix, error feedback, raw vectors."""

    name = "lowrank"
    error_feedback = True

    rank: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise LocalError(f"codec.config.rank must be in [1, {MAX_RANK}], got {self.rank}")

    def settings(self) -> dict[str, int | float]:
        return {"rank": self.rank}

    def factor_rank(self, shape: tuple[int, ...]) -> int | None:
        """The rank of the factors a tensor of ``shape`` is sent as, or None when it is raw."""
        if len(shape) < 2:
            return None
        rows, cols = shape[0], math.prod(shape[1:])
        rank = min(self.rank, rows, cols)
        return rank if (rows + cols) * rank < rows * cols else None

    def layout(self, spec: TensorSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        rank = self.factor_rank(spec.shape)
        if rank is None:
            return {"values": (spec.shape, torch.float32)}
        rows, cols = spec.shape[0], math.prod(spec.shape[1:])
        return {"p": ((rows, rank), torch.float32), "q": ((cols, rank), torch.float32)}

    def encoder(
        self, spec: TensorSpec, seed: int
    ) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
        """A stateful function from one float32 tensor to its parts."""
        rank = self.factor_rank(spec.shape)
        if rank is None:
            return lambda value: {"values": value}
        rows, cols = spec.shape[0], math.prod(spec.shape[1:])
        return _PowerIteration(rows, cols, rank, _seed_for(seed, spec.name))

    def decode(self, spec: TensorSpec, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The float32 tensor; ``parts`` already match :meth:`layout`."""
        if "values" in parts:
            return parts["values"]
        return reconstruct(parts["p"], parts["q"]).reshape(spec.shape)
