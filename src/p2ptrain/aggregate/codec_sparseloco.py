"""The ``sparseloco`` update codec: chunked top-k positions with 2- or 4-bit values,
SparseLoCo-style.

The flattened (row-major) tensor is cut into selection chunks of ``chunk`` elements (4096 by
default, the last one possibly shorter; ``chunk = 0`` takes the whole tensor as one chunk),
and in each chunk of ``m`` elements the encoder keeps the ``max(1, ceil(fraction * m))``
(at most ``m``) largest magnitudes of ``delta + error_decay * residual``: top-k inside fixed
chunks, as SparseLoCo does, so every region of a tensor sends its share every round rather
than a few large rows taking the whole budget. ``k``, the tensor's kept values, is the sum
over its chunks (``0`` for an empty tensor). The kept values are quantised to ``bits`` bits
against one float32 scale, and what was not sent stays in the trainer's error-feedback
residual (:class:`p2ptrain.aggregate.codecs.UpdateEncoder`), decayed by ``error_decay`` each
round. Tensors with fewer than two dimensions (norms, biases) are sent dense with the
``int8`` codec (``dense_vectors = 1``, the default): they are small, and sparsifying them
measured worse. The parts cost 18 bits per kept value at 2 bits (22 at 4) and 4 bytes per
65536 elements or fewer: at fraction 0.02 about 1.13% of the float32 bytes of a large
tensor. The container adds some 80 bytes of framing per part (four per parameter).

``dense_windows`` (default 0) is the dense warm-up: updates of windows ``1 ..
dense_windows`` are encoded with the dense ``int4`` codec instead (:func:`codec_at` gives
the codec of a window), so the first rounds, where the pseudo-gradients are largest and
least alike, are not cut to a few percent. The encoder and every decoder pick the codec from
the window, so the warm-up is part of the experiment, not of a trainer's choice.

The outer step this codec is meant for is plain SGD at learning rate 1
(``outer_optimizer = {name = "sgd", lr = 1.0, momentum = 0.0}``): the error-feedback
residual carries what outer momentum would, and momentum on top of it double counts. The
aggregation rule meant for it is ``contributor_mean``, which averages each coordinate over
the updates that sent it.

Parts
-----
For a tensor sent sparse, the flattened tensor is also cut into chunks of :data:`CHUNK_SIZE`
(65536) elements for the positions, the last one possibly shorter; ``chunks = ceil(n /
65536)``. (A tensor sent dense has the ``int8`` parts ``q`` and ``scale`` instead.)

``counts``   shape ``(chunks,)``, int32: how many kept positions fall in each chunk; each in
             ``[0, chunk length]``, summing to ``k``, and each selection chunk holding
             exactly its share.
``offsets``  shape ``(k,)``, int16: each kept position's place within its chunk, minus 32768
             (so ``[0, 65535]`` fits and the order is kept), chunk after chunk, strictly
             increasing within a chunk and below the chunk's length.
``codes``    shape ``(ceil(k * bits / 8),)``, uint8: one ``bits``-bit code per kept value, in
             position order, packed from the low bits of each byte up (with ``per = 8 / bits``
             codes a byte, code ``i`` sits in byte ``i // per`` at bit ``bits * (i % per)``);
             the unused high bits of the last byte are zero.
``scale``    shape ``(1,)``, float32: finite, ``>= 0`` and not ``-0.0``.

A code's high bit is the sign and its other ``bits - 1`` bits a magnitude level ``m``; the
value is ``±(m + 1) * scale``, one float32 product of an exact small integer and the scale,
negated for the sign: the same bits on every machine. So the levels are ``±1, ±2`` scales at
2 bits and ``±1 … ±8`` at 4 bits; there is no zero level, as kept values are the largest.

Why these choices: a position costs 16 bits rather than 32 (the container has no uint16,
hence the int16 shifted by 32768), the counts cost 4 bytes per 65536 elements, and one scale
per tensor measured as good as one per 64 kept values at 2 bits.

Encoding
--------
Positions: ``torch.topk`` of the magnitudes within each selection chunk, then sorted (ties
are broken the same way on one machine). Scale: the least-squares fit of the levels to the
kept magnitudes, by :data:`FIT_ROUNDS` alternations of "nearest level for this scale" and
"best scale for these levels" (in float64, starting from the largest magnitude over the top
level), then the nearest level for the scale as float32. A zero scale sends zeros. Each step
can only lower the squared error below that of sending nothing, so with error feedback the
residual stays bounded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import torch

from p2ptrain.aggregate.codec_dense import Int8Codec, pack_codes, unpack_codes
from p2ptrain.core.tensors import TensorSpec
from p2ptrain.errors import LocalError, ProtocolViolation

__all__ = ["BITS", "CHUNK_SIZE", "DENSE", "FIT_ROUNDS", "SELECTION_CHUNK", "SparseLoCoCodec"]

CHUNK_SIZE: Final = 1 << 16
"""Elements per chunk: a position within a chunk fits 16 bits."""

BITS: Final = (2, 4)
"""The code widths a manifest may ask for."""

FIT_ROUNDS: Final = 4
"""Alternations of the encoder's least-squares scale fit."""

SELECTION_CHUNK: Final = 4096
"""The default elements per top-k selection chunk (SparseLoCo's 64 x 64)."""

DENSE: Final = Int8Codec()
"""How tensors with fewer than two dimensions are sent (``dense_vectors = 1``)."""

_OFFSET_BIAS: Final = 1 << 15

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True, slots=True)
class SparseLoCoCodec:
    """Top-k sparsification of ``fraction`` of each ``chunk`` of a tensor, ``bits``-bit
    values, one scale, error feedback decayed by ``error_decay``; vectors dense
    (``dense_vectors``); the first ``dense_windows`` windows dense ``int4``."""

    name = "sparseloco"
    error_feedback = True

    fraction: float = 0.02
    bits: int = 2
    chunk: int = SELECTION_CHUNK
    dense_vectors: int = 1
    error_decay: float = 0.95
    dense_windows: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise LocalError(f"codec.config.fraction must be in (0, 1], got {self.fraction}")
        if self.bits not in BITS:
            raise LocalError(f"codec.config.bits must be 2 or 4, got {self.bits}")
        if not 0 <= self.chunk <= CHUNK_SIZE or (self.chunk and CHUNK_SIZE % self.chunk):
            raise LocalError(
                f"codec.config.chunk must be 0 (the whole tensor) or a power of two up to "
                f"{CHUNK_SIZE}, got {self.chunk}"
            )
        if self.dense_vectors not in (0, 1):
            raise LocalError(f"codec.config.dense_vectors must be 0 or 1, got {self.dense_vectors}")
        if not 0.0 < self.error_decay <= 1.0:
            raise LocalError(f"codec.config.error_decay must be in (0, 1], got {self.error_decay}")
        if not 0 <= self.dense_windows <= 1_000_000:
            raise LocalError(
                f"codec.config.dense_windows must be in [0, 1000000], got {self.dense_windows}"
            )

    def settings(self) -> dict[str, int | float]:
        return {
            "bits": self.bits,
            "chunk": self.chunk,
            "dense_vectors": self.dense_vectors,
            "dense_windows": self.dense_windows,
            "error_decay": self.error_decay,
            "fraction": self.fraction,
        }

    def dense(self, spec: TensorSpec) -> bool:
        """Whether ``spec`` is sent dense (``int8``) rather than sparse."""
        return bool(self.dense_vectors) and len(spec.shape) < 2

    def _share(self, length: int) -> int:
        """Values kept from a selection chunk of ``length`` elements."""
        if length == 0:
            return 0
        return min(length, max(1, math.ceil(self.fraction * length)))

    def _selection(self, numel: int) -> tuple[int, int, int]:
        """``(chunk length, whole chunks, length of the last, shorter chunk or 0)``."""
        size = self.chunk or max(numel, 1)
        return size, numel // size, numel % size

    def kept(self, numel: int) -> int:
        """How many values of a sparse ``numel``-element tensor are sent."""
        size, whole, rest = self._selection(numel)
        return whole * self._share(size) + self._share(rest)

    def layout(self, spec: TensorSpec) -> Layout:
        if self.dense(spec):
            return DENSE.layout(spec)
        numel = math.prod(spec.shape)
        k = self.kept(numel)
        return {
            "counts": ((-(-numel // CHUNK_SIZE),), torch.int32),
            "offsets": ((k,), torch.int16),
            "codes": ((-(-k * self.bits // 8),), torch.uint8),
            "scale": ((1,), torch.float32),
        }

    def encoder(
        self, spec: TensorSpec, seed: int
    ) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
        """A function from one float32 tensor to its parts (stateless; ``seed`` unused)."""
        if self.dense(spec):
            return DENSE.encoder(spec, seed)
        numel = math.prod(spec.shape)
        chunks, bits = -(-numel // CHUNK_SIZE), self.bits
        size, whole, rest = self._selection(numel)

        def encode(value: torch.Tensor) -> dict[str, torch.Tensor]:
            flat = value.reshape(-1)
            chosen = self._choose(flat.abs(), size, whole, rest)
            kept = flat[chosen]
            scale, levels = _fit_scale(kept.abs(), 1 << (bits - 1))
            codes = kept.lt(0).to(torch.int32).mul_(1 << (bits - 1)).add_(levels)
            return {
                "counts": torch.bincount(chosen // CHUNK_SIZE, minlength=chunks).to(torch.int32),
                "offsets": (chosen % CHUNK_SIZE - _OFFSET_BIAS).to(torch.int16),
                "codes": pack_codes(codes, bits),
                "scale": scale,
            }

        return encode

    def _choose(self, magnitudes: torch.Tensor, size: int, whole: int, rest: int) -> torch.Tensor:
        """The sorted flat positions kept: each selection chunk's top share."""
        pieces = []
        if whole:
            rows = magnitudes[: whole * size].view(whole, size)
            top = torch.topk(rows, self._share(size), dim=1, sorted=False).indices
            top = torch.sort(top, dim=1).values
            top += torch.arange(whole, dtype=torch.int64).mul_(size).unsqueeze(1)
            pieces.append(top.reshape(-1))
        if rest:
            tail = torch.topk(magnitudes[whole * size :], self._share(rest), sorted=False).indices
            pieces.append(torch.sort(tail).values.add_(whole * size))
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)

    def decode(self, spec: TensorSpec, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The dense float32 tensor; ``parts`` already match :meth:`layout`. Raises
        :class:`ProtocolViolation` for parts that are not the canonical encoding."""
        if self.dense(spec):
            return DENSE.decode(spec, parts)
        numel = math.prod(spec.shape)
        k = self.kept(numel)
        scale = parts["scale"]
        if not bool((torch.isfinite(scale) & ~torch.signbit(scale)).all()):
            raise ProtocolViolation(
                f"sparseloco scale of {spec.name!r} must be finite and >= 0, got {float(scale)}"
            )
        positions = _positions(spec.name, parts["counts"], parts["offsets"], numel, k)
        self._check_shares(spec.name, positions, numel)
        codes = unpack_codes(spec.name, self.name, parts["codes"], k, self.bits)
        dense = torch.zeros(numel, dtype=torch.float32)
        if k:
            top = 1 << (self.bits - 1)
            magnitude = (codes % top + 1).to(torch.float32).mul_(scale)
            values = torch.where(codes.ge(top), magnitude.neg(), magnitude)
            # Unique positions, so the scatter writes each one once: exact and ordered.
            dense.index_copy_(0, positions, values)
        return dense.reshape(spec.shape)

    def _check_shares(self, name: str, positions: torch.Tensor, numel: int) -> None:
        """Each selection chunk holds exactly its share of the (valid, increasing)
        ``positions``."""
        size, whole, rest = self._selection(numel)
        if whole + (rest > 0) <= 1:
            return  # one chunk: its share is k, already checked
        held = torch.bincount(positions // size, minlength=whole + (rest > 0))
        wanted = torch.full((whole + (rest > 0),), self._share(size), dtype=held.dtype)
        if rest:
            wanted[-1] = self._share(rest)
        if not torch.equal(held, wanted):
            raise ProtocolViolation(
                f"sparseloco positions of {name!r} do not keep {self._share(size)} values in "
                f"each chunk of {size}"
            )


def _fit_scale(magnitudes: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 scale (shape ``(1,)``) and the levels ``m`` in ``[0, top)`` that send
    ``magnitudes`` as ``(m + 1) * scale`` (see the module docstring)."""
    wanted = magnitudes.double()
    largest = float(wanted.max()) if wanted.numel() else 0.0
    nothing = torch.zeros(wanted.numel(), dtype=torch.int32)
    if largest == 0.0:
        return torch.zeros(1), nothing
    fitted = largest / top
    for _ in range(FIT_ROUNDS):
        level = wanted.div(fitted).round_().clamp_(1, top)
        fitted = float(wanted.mul(level).sum() / level.square().sum())
    scale = torch.tensor([fitted], dtype=torch.float32)
    if float(scale) == 0.0:  # magnitudes so small the scale underflows float32
        return torch.zeros(1), nothing
    level = wanted.div(float(scale)).round_().clamp_(1, top)
    return scale, level.to(torch.int32).sub_(1)


def _positions(
    name: str, counts: torch.Tensor, offsets: torch.Tensor, numel: int, k: int
) -> torch.Tensor:
    """The flat int64 positions that ``counts`` and ``offsets`` describe, after checking they
    are canonical: counts within their chunks and summing to ``k``, offsets inside their
    chunk and strictly increasing within it."""
    counts = counts.to(torch.int64)
    lengths = torch.full_like(counts, CHUNK_SIZE)
    if counts.numel():
        lengths[-1] = numel - (counts.numel() - 1) * CHUNK_SIZE
    if bool(counts.lt(0).any()) or bool(counts.gt(lengths).any()):
        raise ProtocolViolation(
            f"sparseloco counts of {name!r} must lie between 0 and their chunk's length"
        )
    total = int(counts.sum())
    if total != k:
        raise ProtocolViolation(f"sparseloco counts of {name!r} sum to {total}, not k = {k}")
    chunk = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    within = offsets.to(torch.int64) + _OFFSET_BIAS
    if bool(within.ge(lengths[chunk]).any()):
        raise ProtocolViolation(f"sparseloco offsets of {name!r} lie outside their chunk")
    positions = chunk * CHUNK_SIZE + within
    # Within range, a chunk's positions all lie below the next chunk's: increasing overall
    # is increasing within each chunk.
    if not bool(positions[1:].gt(positions[:-1]).all()):
        raise ProtocolViolation(
            f"sparseloco offsets of {name!r} are not strictly increasing within a chunk"
        )
    return positions
