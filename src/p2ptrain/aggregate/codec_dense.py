"""Dense update codecs: ``fp32``, ``fp16``, ``bf16`` (a cast) and ``int8`` (blockwise absmax).

``fp32`` / ``fp16`` / ``bf16`` send one part per parameter:

``values``  the parameter's shape, in the codec's dtype (round to nearest even).

``int8`` views the flattened (row-major) tensor as consecutive blocks of ``block_size``
elements (the last one may be shorter) and sends:

``q``       the parameter's shape, int8 in ``[-127, 127]``;
``scale``   shape ``(ceil(numel / block_size),)``, float32, one per block, finite, ``>= 0``.

The encoder sets ``scale = absmax / 127`` (rounded up to the next float32 when rounding to
nearest fell below it, so ``|x| / scale <= 127`` holds) and ``q = round(x / scale)``, hence
``|x - q * scale| <= absmax / 127`` per element (a zero block gets scale 0). Decoding is one
elementwise ``q * scale`` per element (int8 -> float32 is exact), the same bits everywhere.

``int4`` and ``int2`` quantise the same way with ``L = 7`` and ``L = 1`` levels a side
(``scale = absmax / L``, codes in ``[-L, L]``; ``int2`` is ternary) and pack the codes:

``codes``   shape ``(ceil(numel * bits / 8),)``, uint8: ``q + L`` of each element in
            ``bits`` bits (4 or 2), element ``i`` in byte ``i // (8 / bits)`` at bit
            ``bits * (i % (8 / bits))``; ``2 L + 1`` and above never appear, and the unused
            high bits of the last byte are zero;
``scale``   as for ``int8``.

Decoding unpacks the codes to int8 and multiplies exactly as ``int8`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from p2ptrain.core.tensors import TensorSpec
from p2ptrain.errors import LocalError, ProtocolViolation

__all__ = [
    "MAX_BLOCK_SIZE",
    "PACKED_BITS",
    "CastCodec",
    "Int8Codec",
    "PackedQuantCodec",
    "pack_codes",
    "unpack_codes",
]

MAX_BLOCK_SIZE = 1 << 20
"""Largest int8 block a manifest may ask for."""

_CAST_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

PACKED_BITS = {"int4": 4, "int2": 2}
"""The packed blockwise codecs and their code widths."""


@dataclass(frozen=True, slots=True)
class CastCodec:
    """Each tensor cast to a float dtype: ``fp32`` (lossless), ``fp16`` or ``bf16``."""

    error_feedback = False

    name: str

    def __post_init__(self) -> None:
        if self.name not in _CAST_DTYPES:
            raise LocalError(f"no cast codec {self.name!r}; use one of {sorted(_CAST_DTYPES)}")

    @property
    def dtype(self) -> torch.dtype:
        return _CAST_DTYPES[self.name]

    def settings(self) -> dict[str, int | float]:
        return {}

    def layout(self, spec: TensorSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"values": (spec.shape, self.dtype)}

    def encoder(
        self, spec: TensorSpec, seed: int
    ) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
        """A function from one float32 tensor to its parts (stateless; ``seed`` unused)."""
        dtype = self.dtype

        def encode(value: torch.Tensor) -> dict[str, torch.Tensor]:
            cast = value.to(dtype)
            if dtype != torch.float32 and not bool(torch.isfinite(cast).all()):
                raise LocalError(
                    f"delta {spec.name!r} overflows {self.name} (largest |value| "
                    f"{float(value.abs().max()):.6g}); use codec bf16 or int8 instead"
                )
            return {"values": cast}

        return encode

    def decode(self, spec: TensorSpec, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The float32 tensor (an exact widening); ``parts`` already match :meth:`layout`."""
        return parts["values"].to(torch.float32)


@dataclass(frozen=True, slots=True)
class Int8Codec:
    """Blockwise absmax int8 quantisation: one float32 scale per ``block_size`` elements."""

    name = "int8"
    error_feedback = False

    block_size: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise LocalError(
                f"codec.config.block_size must be in [1, {MAX_BLOCK_SIZE}], got {self.block_size}"
            )

    def settings(self) -> dict[str, int | float]:
        return {"block_size": self.block_size}

    def layout(self, spec: TensorSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        blocks = -(-math.prod(spec.shape) // self.block_size)
        return {"q": (spec.shape, torch.int8), "scale": ((blocks,), torch.float32)}

    def encoder(
        self, spec: TensorSpec, seed: int
    ) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
        """A function from one float32 tensor to its parts (stateless; ``seed`` unused)."""
        return lambda value: _quantise(value, self.block_size)

    def decode(self, spec: TensorSpec, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``q * scale`` per element; ``parts`` already match :meth:`layout`."""
        q, scale = parts["q"].reshape(-1), parts["scale"]
        if bool(q.eq(-128).any()):
            raise ProtocolViolation(f"int8 codes of {spec.name!r} hold -128; codes lie in ±127")
        return _dequantise(spec, q, scale, self.block_size, "int8")


@dataclass(frozen=True, slots=True)
class PackedQuantCodec:
    """Blockwise absmax quantisation to ``int4`` (±7) or ``int2`` (ternary) codes, packed;
    one float32 scale per ``block_size`` elements."""

    error_feedback = False

    name: str
    block_size: int = 256

    def __post_init__(self) -> None:
        if self.name not in PACKED_BITS:
            raise LocalError(f"no packed codec {self.name!r}; use one of {sorted(PACKED_BITS)}")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise LocalError(
                f"codec.config.block_size must be in [1, {MAX_BLOCK_SIZE}], got {self.block_size}"
            )

    @property
    def bits(self) -> int:
        return PACKED_BITS[self.name]

    @property
    def levels(self) -> int:
        """Codes a side of zero: 7 (int4) or 1 (int2)."""
        return (1 << (self.bits - 1)) - 1

    def settings(self) -> dict[str, int | float]:
        return {"block_size": self.block_size}

    def layout(self, spec: TensorSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        numel = math.prod(spec.shape)
        blocks = -(-numel // self.block_size)
        return {
            "codes": ((-(-numel * self.bits // 8),), torch.uint8),
            "scale": ((blocks,), torch.float32),
        }

    def encoder(
        self, spec: TensorSpec, seed: int
    ) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
        """A function from one float32 tensor to its parts (stateless; ``seed`` unused)."""
        levels, bits = self.levels, self.bits

        def encode(value: torch.Tensor) -> dict[str, torch.Tensor]:
            parts = _quantise(value, self.block_size, levels)
            shifted = parts["q"].reshape(-1).to(torch.int32).add_(levels)
            return {"codes": pack_codes(shifted, bits), "scale": parts["scale"]}

        return encode

    def decode(self, spec: TensorSpec, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``q * scale`` per element, as ``int8``; ``parts`` already match :meth:`layout`."""
        numel = math.prod(spec.shape)
        shifted = unpack_codes(spec.name, self.name, parts["codes"], numel, self.bits)
        if bool(shifted.gt(2 * self.levels).any()):
            raise ProtocolViolation(f"{self.name} codes of {spec.name!r} go beyond ±{self.levels}")
        q = shifted.sub_(self.levels).to(torch.int8)
        return _dequantise(spec, q, parts["scale"], self.block_size, self.name)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative ``bits``-bit codes packed low bits first, the last byte's spare bits 0."""
    per_byte = 8 // bits
    padded = torch.zeros(-(-codes.numel() // per_byte) * per_byte, dtype=torch.int32)
    padded[: codes.numel()] = codes
    shifts = torch.arange(0, 8, bits, dtype=torch.int32)
    return padded.view(-1, per_byte).bitwise_left_shift(shifts).sum(dim=1).to(torch.uint8)


def unpack_codes(
    name: str, codec: str, packed: torch.Tensor, count: int, bits: int
) -> torch.Tensor:
    """The ``count`` codes of ``packed`` (int32); :class:`ProtocolViolation` unless the
    spare bits are zero."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32)
    codes = packed.to(torch.int32)[:, None].bitwise_right_shift(shifts) & ((1 << bits) - 1)
    codes = codes.reshape(-1)
    if bool(codes[count:].any()):
        raise ProtocolViolation(f"{codec} codes of {name!r} have non-zero padding bits")
    return codes[:count].clone()


def _dequantise(
    spec: TensorSpec, q: torch.Tensor, scale: torch.Tensor, block_size: int, codec: str
) -> torch.Tensor:
    """``q * scale`` per element (``q`` flat int8, one scale a block): the same bits on
    every machine."""
    if not bool((torch.isfinite(scale) & scale.ge(0)).all()):
        raise ProtocolViolation(f"{codec} scales of {spec.name!r} must be finite and >= 0")
    dense = torch.empty(q.numel(), dtype=torch.float32)
    full = q.numel() // block_size * block_size
    blocks = full // block_size
    if full:
        out = dense[:full].view(blocks, block_size)
        torch.mul(q[:full].view(blocks, block_size), scale[:blocks, None], out=out)
    if full < q.numel():
        torch.mul(q[full:], scale[blocks:], out=dense[full:])
    return dense.reshape(spec.shape)


def _quantise(value: torch.Tensor, block_size: int, levels: int = 127) -> dict[str, torch.Tensor]:
    """Codes in ``[-levels, levels]`` (int8) and per-block scales of one float32 tensor (see
    the module docstring)."""
    flat = value.reshape(-1)
    numel = flat.numel()
    blocks = -(-numel // block_size)
    if numel % block_size:
        padded = torch.zeros(blocks * block_size, dtype=torch.float32)
        padded[:numel] = flat
    else:
        padded = flat
    grid = padded.view(blocks, block_size)
    absmax = grid.abs().amax(dim=1) if numel else torch.zeros(0)
    scale = absmax / float(levels)
    # Round the scale up where rounding to nearest fell below absmax / levels (float64 is
    # exact here), so no code needs more than levels; in the subnormal range this also keeps
    # it > 0.
    low = scale.double().mul(float(levels)).lt(absmax.double())
    scale = torch.where(low, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    divisor = torch.where(scale.gt(0), scale, torch.ones_like(scale))
    codes = grid.div(divisor[:, None]).round_().clamp_(-levels, levels).to(torch.int8)
    return {"q": codes.reshape(-1)[:numel].reshape(value.shape), "scale": scale}
