"""Update blobs read span by span: a reduction holds one span of every update, not every
update whole.

:class:`UpdateVector` is an update blob seen as the flat float32 vector a rule aggregates
(parameters in sorted-name order, see :func:`~p2ptrain.aggregate.exact.flatten`).
Opening one reads and checks only the blob's headers (the safetensors container, the codec
header, the parts' names, shapes and dtypes: every check of
:func:`~p2ptrain.aggregate.codecs.decode_update` that needs no part values); then
``vector[start:end]`` reads the bytes of that span from the blob's :class:`ByteSource` (an
in-memory blob, or a file read by range) and decodes them, checking the values it reads as
``decode_update`` checks them. A reduction reads every span of every update once before
anything else (finite values, norms), so a blob is rejected, or its values are the bits
``decode_update`` gives, whatever span a later pass asks for.

The dense codecs (``fp32``, ``fp16``, ``bf16``, ``int8``, ``int4``, ``int2``) decode any
span by itself; the others (``topk``, ``sparseloco``, ``lowrank``) decode the parameter the
span falls in whole and keep it for the next span, so a reader holds at most one
parameter's values.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np
import torch

from p2ptrain.aggregate import native
from p2ptrain.aggregate.codec_dense import CastCodec, Int8Codec, PackedQuantCodec
from p2ptrain.aggregate.codecs import (
    HEADER_TENSOR,
    ParameterCodec,
    check_parts,
    codec_for,
    expected_schema,
    part_layout,
    read_codec_header,
)
from p2ptrain.core.manifests import CodecSpec
from p2ptrain.core.tensors import TensorSlot, TensorSpec, read_layout, uint8_alias
from p2ptrain.errors import LocalError, ProtocolViolation

__all__ = ["ByteSource", "Int8Codes", "MemoryBytes", "UpdateVector", "source_of"]

#: The most values one read decodes: a caller's span (a pass's window) is at most this.
MAX_SPAN: Final = 1 << 24


class ByteSource(Protocol):
    """Where a blob's bytes are: its size, and any range of them."""

    def __len__(self) -> int: ...

    def read(self, offset: int, length: int) -> bytes | bytearray | memoryview:
        """Exactly ``length`` bytes from ``offset``; may be a view valid until the source
        is dropped. Raises :class:`OSError` when the bytes cannot be read."""
        ...

    @property
    def verified_id(self) -> str | None:
        """The blob id the bytes are known to hash to (a store that checked them when it
        took them in), or None: the reader of the blob hashes them itself."""
        ...

    def memory(self) -> memoryview | None:
        """All the bytes as one read-only view (in memory, or a file mapped), valid while
        the source lives; None when they can only be read by range."""
        ...

    def forget(self, offset: int, length: int) -> None:
        """Those bytes of :meth:`memory` will not be read again soon: a mapped file lets go
        of their pages (a pass then holds a window of its cohort, not all of it)."""
        ...


class MemoryBytes:
    """A blob held in memory."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        self._view = view if view.format == "B" and view.ndim == 1 else view.cast("B")

    def __len__(self) -> int:
        return len(self._view)

    def read(self, offset: int, length: int) -> memoryview:
        return self._view[offset : offset + length]

    @property
    def verified_id(self) -> str | None:
        return None

    def memory(self) -> memoryview:
        return self._view

    def forget(self, offset: int, length: int) -> None:
        pass  # the bytes are the caller's memory


def source_of(blob: bytes | bytearray | memoryview | ByteSource) -> ByteSource:
    """``blob`` as a byte source (bytes in memory are wrapped)."""
    if isinstance(blob, bytes | bytearray | memoryview):
        return MemoryBytes(blob)
    return blob


@dataclass(frozen=True, slots=True)
class Int8Codes:
    """An int8 update's codes in memory: its non-empty parameters hold positions
    ``starts[k] .. starts[k + 1] - 1``; ``q[k]`` and ``scale[k]`` are the addresses of
    parameter ``k``'s codes and scales (one per ``block_size`` codes)."""

    starts: tuple[int, ...]
    block_size: int
    q: tuple[int, ...]
    scale: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Parameter:
    spec: TensorSpec
    start: int  # first flat position
    numel: int
    parts: dict[str, TensorSlot]


class UpdateVector:
    """One update blob as the flat float32 vector of its pseudo-gradient, decoded span by
    span. Raises :class:`ProtocolViolation` (bad headers) on opening, or from a read (bad
    values, including values that are not finite), and :class:`OSError` when the source
    cannot be read. ``vector[start:end]`` is valid until the next read of this vector."""

    dtype = torch.float32

    def __init__(
        self,
        blob: bytes | bytearray | memoryview | ByteSource,
        codec: CodecSpec,
        schema: Iterable[TensorSpec],
        *,
        max_bytes: int,
    ) -> None:
        self._source = source_of(blob)
        self._codec: ParameterCodec = codec_for(codec)
        expected = expected_schema(schema)
        size = len(self._source)
        if size > max_bytes:
            raise ProtocolViolation(f"update blob is {size} bytes, over the limit of {max_bytes}")
        layout = read_layout(self._source.read, size, max_bytes=max_bytes)
        self._data_start = layout.data_start
        header = layout.slots.get(HEADER_TENSOR)
        if header is None or header.dtype != torch.uint8 or len(header.shape) != 1:
            raise ProtocolViolation(f"update has no 1-D uint8 {HEADER_TENSOR!r} codec header")
        text = self._bytes(header, 0, header.end - header.begin).numpy().tobytes()
        model = read_codec_header(text, self._codec, expected)
        parts = {name: slot for name, slot in layout.slots.items() if name != HEADER_TENSOR}
        found = {name: (slot.shape, slot.dtype) for name, slot in parts.items()}
        check_parts(found, part_layout(self._codec, model), self._codec.name)
        self._parameters: list[_Parameter] = []
        position = 0
        for spec in model:
            numel = math.prod(spec.shape)
            names = self._codec.layout(spec)
            slots = {part: parts[f"{spec.name}/{part}"] for part in names}
            self._parameters.append(_Parameter(spec, position, numel, slots))
            position += numel
        self._numel = position
        self._starts = [p.start for p in self._parameters]
        self._buffer = torch.empty(0, dtype=torch.float32)
        self._whole: tuple[str, torch.Tensor] | None = None
        self._checked = False
        self._memory: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        # keep_decoded(): the values decoded so far (positions 0 .. _kept_upto), and
        # whether every decode that filled them looked for non-finite values
        self._kept: torch.Tensor | None = None
        self._kept_upto = 0
        self._kept_checked = True

    def int8_codes(self) -> Int8Codes | None:
        """Where its int8 codes and scales lie in memory, for a pass that decodes them in
        the C kernel (:class:`~p2ptrain.aggregate.native.Int8Rows`); None when the codec is
        not int8 or the blob cannot be seen whole in memory. The vector keeps the memory
        mapped while it lives; the headers were checked on opening, so every address and
        length lies inside the blob."""
        if not isinstance(self._codec, Int8Codec):
            return None
        memory = self._source.memory()
        parameters = [p for p in self._parameters if p.numel]
        if memory is None or not parameters:
            return None
        self._memory = np.frombuffer(memory, dtype=np.uint8)
        base = int(self._memory.ctypes.data) + self._data_start
        return Int8Codes(
            starts=(*(p.start for p in parameters), self._numel),
            block_size=self._codec.block_size,
            q=tuple(base + p.parts["q"].begin for p in parameters),
            scale=tuple(base + p.parts["scale"].begin for p in parameters),
        )

    def forget(self, start: int, end: int) -> None:
        """Values ``start .. end`` were read from :meth:`int8_codes`' memory and will not be
        again soon: a mapped blob lets go of their codes' pages."""
        if self._memory is None:
            return
        first = max(0, bisect.bisect_right(self._starts, start) - 1)
        for parameter in self._parameters[first:]:
            if parameter.start >= end:
                break
            low = max(start, parameter.start) - parameter.start
            high = min(end, parameter.start + parameter.numel) - parameter.start
            if high > low:
                q = parameter.parts["q"]
                self._source.forget(self._data_start + q.begin + low, high - low)

    def numel(self) -> int:
        return self._numel

    def dim(self) -> int:
        return 1

    def __len__(self) -> int:
        return self._numel

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, end, step = index.indices(self._numel)
        if step != 1 or end - start > MAX_SPAN:
            raise LocalError(f"an update vector reads contiguous spans of up to {MAX_SPAN}")
        width = max(0, end - start)
        if self._buffer.numel() < width:
            self._buffer = torch.empty(width, dtype=torch.float32)
        out = self._buffer[:width]
        self.read_into(start, end, out)
        return out

    @property
    def checked_finite(self) -> bool:
        """Whether the last read found every value it decoded finite (else it raised); False
        when it did not look (a decode that cannot make a value infinite is not checked:
        a caller that needs finite values checks them itself)."""
        return self._checked

    def keep_decoded(self) -> None:
        """Keep the values as they are decoded, so that a later pass copies them instead of
        decoding them again (``numel()`` float32 values of memory: for a reduction whose
        cohort is small enough to hold whole). Only reads that continue from the first
        value are kept; any other read decodes as before."""
        if self._kept is None:
            self._kept = torch.empty(self._numel, dtype=torch.float32)

    def read_into(self, start: int, end: int, out: torch.Tensor) -> None:
        """Decode values ``start .. end`` into ``out`` (float32, ``end - start`` values)."""
        kept = self._kept
        if kept is None or start > self._kept_upto:
            self._decode_into(start, end, out)
        elif end <= self._kept_upto:
            out.copy_(kept[start:end])
            self._checked = self._kept_checked
        else:  # the span reaches past what is kept: decode the rest, keep it, copy
            upto = self._kept_upto
            self._decode_into(upto, end, kept[upto:end])
            self._kept_checked = self._kept_checked and self._checked
            self._kept_upto = end
            out.copy_(kept[start:end])
            self._checked = self._kept_checked

    def _decode_into(self, start: int, end: int, out: torch.Tensor) -> None:
        self._checked = True  # until a decode that does not look
        first = max(0, bisect.bisect_right(self._starts, start) - 1)
        for parameter in self._parameters[first:]:
            if parameter.start >= end:
                break
            low = max(start, parameter.start)
            high = min(end, parameter.start + parameter.numel)
            if high <= low:
                continue
            target = out[low - start : high - start]
            self._decode(parameter, low - parameter.start, high - parameter.start, target)

    # --- bytes ---------------------------------------------------------------------------

    def _bytes(self, slot: TensorSlot, first: int, last: int) -> torch.Tensor:
        """Bytes ``first .. last`` of ``slot``'s data, as a uint8 tensor."""
        offset = self._data_start + slot.begin + first
        data = self._source.read(offset, last - first)
        if len(data) != last - first:
            raise OSError(f"read {len(data)} bytes of an update blob, expected {last - first}")
        return uint8_alias(data) if last > first else torch.empty(0, dtype=torch.uint8)

    def _part(self, parameter: _Parameter, part: str, first: int, last: int) -> torch.Tensor:
        """Elements ``first .. last`` of a part (flattened), in its dtype."""
        slot = parameter.parts[part]
        size = slot.dtype.itemsize
        return self._bytes(slot, first * size, last * size).view(slot.dtype)

    # --- decoding ------------------------------------------------------------------------

    def _decode(self, parameter: _Parameter, low: int, high: int, out: torch.Tensor) -> None:
        codec, name = self._codec, parameter.spec.name
        if not isinstance(codec, Int8Codec):
            self._checked = False
        if isinstance(codec, CastCodec):
            out.copy_(self._part(parameter, "values", low, high))  # an exact widening
        elif isinstance(codec, Int8Codec):
            q = self._part(parameter, "q", low, high)
            if self._native_int8(parameter, q, (low, high), codec.block_size, out):
                return  # the kernel checked that every value is finite
            self._checked = False
            if q.numel() and int(q.min()) == -128:
                raise ProtocolViolation(f"int8 codes of {name!r} hold -128; codes lie in ±127")
            self._dequantise(parameter, q, (low, high), block_size=codec.block_size, out=out)
        elif isinstance(codec, PackedQuantCodec):
            q = self._packed(parameter, codec, low, high)
            self._dequantise(parameter, q, (low, high), block_size=codec.block_size, out=out)
        else:
            out.copy_(self._whole_parameter(parameter)[low:high])

    def _native_int8(
        self,
        parameter: _Parameter,
        q: torch.Tensor,
        span: tuple[int, int],
        block_size: int,
        out: torch.Tensor,
    ) -> bool:
        """The int8 decode of ``span`` by the C kernel, with the same checks; False when
        the kernel is not there."""
        low, high = span
        first_block, last_block = low // block_size, (high - 1) // block_size + 1
        scale = self._part(parameter, "scale", first_block, last_block)
        lead = low - first_block * block_size
        status = native.dequantise_int8(q, scale, block_size, lead, out)
        if status is None:
            return False
        name = parameter.spec.name
        if status == 1:
            raise ProtocolViolation(f"int8 codes of {name!r} hold -128; codes lie in ±127")
        if status == 3:
            raise ProtocolViolation(
                f"int8 values of {name!r} overflow float32 (a code times its scale is infinite)"
            )
        if status:
            raise ProtocolViolation(f"int8 scales of {name!r} must be finite and >= 0")
        return True

    def _dequantise(
        self,
        parameter: _Parameter,
        q: torch.Tensor,
        span: tuple[int, int],
        *,
        block_size: int,
        out: torch.Tensor,
    ) -> None:
        """``q * scale`` per element of ``low .. high`` (one float32 rounding each, as
        ``codec_dense`` decodes a whole tensor)."""
        low, high = span
        first_block, last_block = low // block_size, (high - 1) // block_size + 1
        scale = self._part(parameter, "scale", first_block, last_block)
        if not bool((torch.isfinite(scale) & scale.ge(0)).all()):
            raise ProtocolViolation(
                f"{self._codec.name} scales of {parameter.spec.name!r} must be finite and >= 0"
            )
        # the head of a block the span starts inside, whole blocks, the tail of the last
        head = min(high, (first_block + 1) * block_size) - low
        torch.mul(q[:head], scale[0:1], out=out[:head])
        whole = max(0, (high - low - head) // block_size)
        if whole:
            blocks = slice(head, head + whole * block_size)
            torch.mul(
                q[blocks].view(whole, block_size),
                scale[1 : 1 + whole, None],
                out=out[blocks].view(whole, block_size),
            )
        rest = head + whole * block_size
        if rest < high - low:
            torch.mul(q[rest:], scale[1 + whole : 2 + whole], out=out[rest:])

    def _packed(
        self, parameter: _Parameter, codec: PackedQuantCodec, low: int, high: int
    ) -> torch.Tensor:
        """The int8 codes of elements ``low .. high`` of a packed (int4, int2) parameter."""
        bits, name = codec.bits, parameter.spec.name
        per_byte = 8 // bits
        first_byte = low // per_byte
        last_byte = -(-high // per_byte)
        packed = self._part(parameter, "codes", first_byte, last_byte)
        shifts = torch.arange(0, 8, bits, dtype=torch.int32)
        codes = packed.to(torch.int32)[:, None].bitwise_right_shift(shifts) & ((1 << bits) - 1)
        codes = codes.reshape(-1)
        skip = low - first_byte * per_byte
        if high == parameter.numel and bool(codes[skip + high - low :].any()):
            raise ProtocolViolation(f"{codec.name} codes of {name!r} have non-zero padding bits")
        shifted = codes[skip : skip + high - low]
        if bool(shifted.gt(2 * codec.levels).any()):
            raise ProtocolViolation(f"{codec.name} codes of {name!r} go beyond ±{codec.levels}")
        return shifted.sub(codec.levels).to(torch.int8)

    def _whole_parameter(self, parameter: _Parameter) -> torch.Tensor:
        """The parameter decoded whole (kept until another one is asked for)."""
        if self._whole is not None and self._whole[0] == parameter.spec.name:
            return self._whole[1]
        self._whole = None
        parts = {
            part: self._part(parameter, part, 0, math.prod(slot.shape)).clone().view(slot.shape)
            for part, slot in parameter.parts.items()
        }
        value = self._codec.decode(parameter.spec, parts).reshape(-1)
        self._whole = (parameter.spec.name, value)
        return value
