"""The canonical encoding of a window's aggregate pseudo-gradient (the head's
``aggregate_blob``).

A certified head binds the aggregate that produced it, so a follower that holds the parent's
weights and outer-optimizer state downloads only the aggregate, applies the outer step itself
and checks the result against the head's weights and optimizer hashes (DESIGN §4 step 5,
``docs/protocol.md`` §10). Sparse codecs give sparse aggregates, so each tensor is stored
sparse when that is smaller:

``__aggregate__``   uint8: ``p2ptrain-aggregate/1`` (the format tag).
``<name>/dense``    float32 (bfloat16, see below), the tensor's shape: every value, or
``<name>/counts``   int32, ``(ceil(numel / 65536),)``: how many stored values fall in each
                    chunk of 65,536 flattened positions;
``<name>/offsets``  int16, ``(nnz,)``: each stored value's position within its chunk, minus
                    32,768 (so 0..65,535 fits), strictly increasing within a chunk;
``<name>/values``   float32 (bfloat16), ``(nnz,)``: the stored values.

A value is stored unless its bits are those of ``+0.0`` (``-0.0`` is stored: the outer step
must see the same bits). The sparse form is used exactly when ``(2 + b) * nnz + 4 * chunks
< b * numel``, ``b`` the bytes of a stored value (4, or 2 for bfloat16). Encoding is a pure
function of the tensors' bits, so every reducer and validator that computed the same
aggregate writes the same bytes and the same hash; decoding checks everything and gives the
tensors back bit for bit.

With ``aggregation.precision`` ``bf16``, the aggregate is rounded to bfloat16 before the outer
step (IEEE round to nearest even, the same bits everywhere) and stored in the form above with
bfloat16 values: a sparse aggregate (a sparse codec's, averaged over its contributors) costs 4
bytes a sent coordinate, and a dense one half its float32 bytes.

With ``aggregation.precision`` ``int8``, ``int4`` or ``int2`` in the manifest, the aggregate
is rounded before the outer step: each tensor is cut into blocks of :data:`QUANT_BLOCK`
flattened values, each block quantised against its absolute maximum exactly as the update
codec of that name does with ``block_size = 256`` (:mod:`.codec_dense`: IEEE float32
division, round half to even, ±127, ±7 or ±1), and the outer step applies the rounded values
``q * scale``. The blob then holds, for every tensor, that codec's parts under
``<name>/<part>``:

``int8``            ``<name>/q`` (int8, the tensor's shape, never -128) and ``<name>/scale``;
``int4``, ``int2``  ``<name>/codes`` (uint8, the packed codes) and ``<name>/scale``;

``<name>/scale`` float32, ``(ceil(numel / 256),)``, finite, ``>= 0``: a quarter, an eighth or
a sixteenth of the float32 bytes. Every machine rounds the same aggregate to the same codes,
so the head still binds one blob and a follower's outer step of its decoded values
reproduces the certified weights bit for bit.

A rounded tensor few of whose values are stored (bits other than ``+0.0``: a sparse codec's
aggregate) is stored sparse instead, exactly when ``4 * chunks + 2 * nnz + bytes(nnz) <
bytes(numel)``, ``bytes(n)`` the quantiser's parts for ``n`` values: ``<name>/counts`` and
``<name>/offsets`` as above, and the quantiser's parts for the ``nnz`` stored values alone,
in position order, as one vector (blocks of :data:`QUANT_BLOCK` stored values). A stored
value that rounds to zero stays stored; the positions not stored are zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Final

import torch

from p2ptrain.aggregate.codec_dense import Int8Codec, PackedQuantCodec
from p2ptrain.core.spool import BlobSpool, MemorySpool, SpooledBlob
from p2ptrain.core.tensors import (
    PartWriter,
    TensorSpec,
    decode_state_dict,
    encode_state_dict,
    read_layout,
    write_state_dict,
)
from p2ptrain.errors import ProtocolViolation

__all__ = [
    "AGGREGATE_FORMAT",
    "QUANT_BLOCK",
    "decode_aggregate",
    "encode_aggregate",
    "settle_aggregate",
    "settles_unchanged",
]

AGGREGATE_FORMAT: Final = "p2ptrain-aggregate/1"
#: Values per scale of a rounded aggregate.
QUANT_BLOCK: Final = 256
_QUANTISERS: Final[dict[str, Int8Codec | PackedQuantCodec]] = {
    "int8": Int8Codec(block_size=QUANT_BLOCK),
    "int4": PackedQuantCodec("int4", block_size=QUANT_BLOCK),
    "int2": PackedQuantCodec("int2", block_size=QUANT_BLOCK),
}
_TAG: Final = "__aggregate__"
_TAG_BYTES: Final = AGGREGATE_FORMAT.encode()
_CHUNK: Final = 1 << 16
#: Values a sparse tensor is encoded at a time (whole chunks).
_SLAB: Final = 64 * _CHUNK
_OFFSET_BIAS: Final = 1 << 15


def _chunks(numel: int) -> int:
    return math.ceil(numel / _CHUNK)


def _sparse_is_smaller(nnz: int, numel: int, itemsize: int = 4) -> bool:
    return (2 + itemsize) * nnz + 4 * _chunks(numel) < itemsize * numel


#: The integer view of a stored dtype, whose zero is exactly the value's ``+0.0``.
_BITS: Final = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
#: The dtype an unrounded (``fp32``) or ``bf16`` aggregate stores its values in.
_STORED: Final = {"fp32": torch.float32, "bf16": torch.bfloat16}


def encode_aggregate(
    tensors: Mapping[str, torch.Tensor], spool: BlobSpool | None = None
) -> bytearray | SpooledBlob:
    """The canonical bytes of an aggregate (float32 or bfloat16 CPU tensors, any names), in
    memory or written into a sink of ``spool``. A sparse tensor is encoded :data:`_SLAB`
    values at a time, so its positions never take more than a slab's worth of memory."""
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
        _TAG: (torch.uint8, (len(_TAG_BYTES),))
    }
    stored: dict[str, int] = {}  # each sparse tensor's count of stored values
    for name, tensor in tensors.items():
        flat = tensor.detach().reshape(-1)
        nnz = int(torch.count_nonzero(flat.view(_BITS[flat.dtype])))
        if not _sparse_is_smaller(nnz, flat.numel(), flat.element_size()):
            layout[f"{name}/dense"] = (flat.dtype, tuple(tensor.shape))
            continue
        stored[name] = nnz
        layout[f"{name}/counts"] = (torch.int32, (_chunks(flat.numel()),))
        layout[f"{name}/offsets"] = (torch.int16, (nnz,))
        layout[f"{name}/values"] = (flat.dtype, (nnz,))
    writer = PartWriter(layout, MemorySpool() if spool is None else spool)
    writer.write(_TAG, 0, torch.tensor(list(_TAG_BYTES), dtype=torch.uint8))
    for name, tensor in tensors.items():
        flat = tensor.detach().reshape(-1)
        if name not in stored:
            writer.write(f"{name}/dense", 0, flat)
            continue
        written = 0
        for first in range(0, flat.numel(), _SLAB):
            slab = flat[first : first + _SLAB]
            positions = slab.view(_BITS[slab.dtype]).ne(0).nonzero().reshape(-1)
            counts = torch.bincount(positions // _CHUNK, minlength=_chunks(slab.numel()))
            writer.write(f"{name}/counts", first // _CHUNK, counts.to(torch.int32))
            offsets = (positions % _CHUNK - _OFFSET_BIAS).to(torch.int16)
            writer.write(f"{name}/offsets", written, offsets)
            writer.write(f"{name}/values", written, slab[positions])
            written += positions.numel()
        assert written == stored[name]
    return writer.close()


def _quantised_bytes(quantiser: Int8Codec | PackedQuantCodec, numel: int) -> int:
    """The bytes of ``quantiser``'s parts for ``numel`` values."""
    layout = quantiser.layout(TensorSpec("", (numel,), "float32"))
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())


def _rounded_sparse_is_smaller(
    quantiser: Int8Codec | PackedQuantCodec, nnz: int, numel: int
) -> bool:
    """Whether a rounded tensor of ``numel`` values, ``nnz`` of them not ``+0.0``, is stored
    sparse: its positions and the rounding of those values alone take fewer bytes."""
    sparse = 4 * _chunks(numel) + 2 * nnz + _quantised_bytes(quantiser, nnz)
    return sparse < _quantised_bytes(quantiser, numel)


def _settle_sparse(
    quantiser: Int8Codec | PackedQuantCodec,
    name: str,
    flat: torch.Tensor,
    nnz: int,
    container: dict[str, torch.Tensor],
    *,
    in_place: bool,
) -> torch.Tensor:
    """Round the ``nnz`` values of ``flat`` that are not ``+0.0`` as one tensor of ``nnz``
    values (blocks of stored values, not of positions), put their positions and parts into
    ``container`` and give back the rounded flat tensor (zero elsewhere)."""
    positions = flat.view(torch.int32).ne(0).nonzero().reshape(-1)
    assert positions.numel() == nnz
    counts = torch.bincount(positions // _CHUNK, minlength=_chunks(flat.numel()))
    container[f"{name}/counts"] = counts.to(torch.int32)
    container[f"{name}/offsets"] = (positions % _CHUNK - _OFFSET_BIAS).to(torch.int16)
    stored = TensorSpec(name, (nnz,), "float32")
    parts = quantiser.encoder(stored, 0)(flat[positions])
    container.update({f"{name}/{part}": value for part, value in parts.items()})
    settled = flat if in_place else torch.empty(flat.numel(), dtype=torch.float32)
    settled.zero_()
    settled.index_copy_(0, positions, quantiser.decode(stored, parts))
    return settled


def _tagged() -> dict[str, torch.Tensor]:
    """A container holding only the format tag."""
    return {_TAG: torch.tensor(list(_TAG_BYTES), dtype=torch.uint8)}


def settles_unchanged(precision: str) -> bool:
    """Whether :func:`settle_aggregate` at ``precision`` gives back the tensors' own values
    (``fp32`` with a spool): an outer step may then apply them while the blob is written."""
    return precision == "fp32"


def settle_aggregate(
    tensors: Mapping[str, torch.Tensor],
    precision: str = "fp32",
    spool: BlobSpool | None = None,
    *,
    in_place: bool = False,
) -> tuple[dict[str, torch.Tensor], bytearray | SpooledBlob]:
    """(what the outer step applies, the canonical blob) of an aggregate at the manifest's
    ``aggregation.precision``: the tensors' values and :func:`encode_aggregate`'s bytes
    (``fp32``; in memory, a tensor stored dense is given as a view of the blob, so the
    caller may drop its own copy), or their rounding and its codes (``int8``, ``int4``,
    ``int2``: see the module docstring). With ``spool``, the blob is written into one of
    its sinks (a file, say) and the tensors given are the values themselves. ``in_place``:
    a rounding overwrites ``tensors`` (the caller's own) instead of taking new memory."""
    if precision == "fp32" and spool is not None:
        return dict(tensors), encode_aggregate(tensors, spool)
    if precision == "bf16":
        halves = {name: tensor.detach().to(torch.bfloat16) for name, tensor in tensors.items()}
        widened = {name: half.to(torch.float32) for name, half in halves.items()}
        return widened, encode_aggregate(halves, spool)
    if precision == "fp32":
        blob = encode_aggregate(tensors)
        assert isinstance(blob, bytearray)
        layout = read_layout(lambda offset, length: blob[offset : offset + length], len(blob))
        values = dict(tensors)
        for name, tensor in tensors.items():
            slot = layout.slots.get(f"{name}/dense")
            if slot is not None and tensor.numel():
                values[name] = torch.frombuffer(
                    blob,
                    dtype=torch.float32,
                    offset=layout.data_start + slot.begin,
                    count=tensor.numel(),
                ).view(tensor.shape)
        return values, blob
    quantiser = _QUANTISERS[precision]
    container = _tagged()
    rounded: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        spec = TensorSpec(name, tuple(tensor.shape), "float32")
        flat = tensor.detach().reshape(-1)
        nnz = int(torch.count_nonzero(flat.view(torch.int32))) if flat.numel() else 0
        if flat.numel() and _rounded_sparse_is_smaller(quantiser, nnz, flat.numel()):
            rounded[name] = _settle_sparse(quantiser, name, flat, nnz, container, in_place=in_place)
            rounded[name] = rounded[name].view(tensor.shape)
            continue
        if not flat.numel():
            parts = quantiser.encoder(spec, 0)(tensor.detach())
            rounded[name] = quantiser.decode(spec, parts)
            container.update({f"{name}/{part}": value for part, value in parts.items()})
            continue
        # a slab at a time (whole blocks, whole bytes of packed codes: the same parts),
        # so the quantiser's temporaries are a slab's, not the tensor's
        settled = flat if in_place else torch.empty(flat.numel(), dtype=torch.float32)
        pieces: dict[str, list[torch.Tensor]] = {}
        for first in range(0, flat.numel(), _SLAB):
            slab = flat[first : first + _SLAB]
            piece = TensorSpec(name, (slab.numel(),), "float32")
            parts = quantiser.encoder(piece, 0)(slab)
            settled[first : first + slab.numel()] = quantiser.decode(piece, parts)
            for part, value in parts.items():
                pieces.setdefault(part, []).append(value.reshape(-1))
        for part, (shape, _) in quantiser.layout(spec).items():
            container[f"{name}/{part}"] = torch.cat(pieces[part]).view(shape)
        rounded[name] = settled.view(tensor.shape)
    if spool is not None:
        return rounded, write_state_dict(container, spool)
    return rounded, encode_state_dict(container)


def decode_aggregate(
    blob: bytes | bytearray,
    schema: Iterable[TensorSpec],
    *,
    max_bytes: int,
    precision: str = "fp32",
) -> dict[str, torch.Tensor]:
    """The aggregate's float32 tensors, one per ``schema`` entry, as the outer step applied
    them. Raises :class:`ProtocolViolation` for any bytes :func:`settle_aggregate` would not
    write at ``precision``."""
    parts = decode_state_dict(blob, max_bytes=max_bytes)
    tag = parts.pop(_TAG, None)
    if tag is None or bytes(tag.tolist()) != AGGREGATE_FORMAT.encode():
        raise ProtocolViolation(f"not a {AGGREGATE_FORMAT} blob (its format tag is missing)")
    quantiser = _QUANTISERS.get(precision)
    out: dict[str, torch.Tensor] = {}
    for spec in schema:
        if quantiser is None:
            out[spec.name] = _decode_one(spec, parts, _STORED[precision])
        else:
            out[spec.name] = _decode_rounded(quantiser, spec, parts)
    if parts:
        raise ProtocolViolation(f"aggregate holds parts of no parameter: {sorted(parts)[:3]}")
    return out


def _decode_one(
    spec: TensorSpec, parts: dict[str, torch.Tensor], stored: torch.dtype
) -> torch.Tensor:
    """One tensor stored dense or sparse with ``stored`` values, as float32."""
    name, numel, itemsize, bits = spec.name, math.prod(spec.shape), stored.itemsize, _BITS[stored]
    dense = parts.pop(f"{name}/dense", None)
    sparse = [parts.pop(f"{name}/{part}", None) for part in ("counts", "offsets", "values")]
    if dense is not None:
        if any(part is not None for part in sparse):
            raise ProtocolViolation(f"aggregate {name!r} is both dense and sparse")
        if dense.dtype != stored or tuple(dense.shape) != spec.shape:
            raise ProtocolViolation(f"aggregate {name!r} is not {stored} {spec.shape}")
        nnz = int(dense.reshape(-1).view(bits).ne(0).sum())
        if _sparse_is_smaller(nnz, numel, itemsize):
            raise ProtocolViolation(f"aggregate {name!r} is dense where sparse is canonical")
        return dense.to(torch.float32)
    counts, offsets, values = sparse
    if counts is None or offsets is None or values is None:
        raise ProtocolViolation(f"aggregate lacks parameter {name!r}")
    nnz = values.numel()
    if values.dtype != stored or tuple(values.shape) != (nnz,) or offsets.numel() != nnz:
        raise ProtocolViolation(f"aggregate {name!r}: parts have the wrong dtypes or shapes")
    if not _sparse_is_smaller(nnz, numel, itemsize):
        raise ProtocolViolation(f"aggregate {name!r} is sparse where dense is canonical")
    positions = _positions(name, counts, offsets, numel)
    if bool(values.view(bits).eq(0).any()):
        raise ProtocolViolation(f"aggregate {name!r} stores a +0.0 it must leave out")
    flat = torch.zeros(numel, dtype=torch.float32)
    flat.index_copy_(0, positions, values.to(torch.float32))
    return flat.reshape(spec.shape)


def _positions(name: str, counts: torch.Tensor, offsets: torch.Tensor, numel: int) -> torch.Tensor:
    """The flattened positions a sparse tensor's ``counts`` and ``offsets`` name (int64,
    strictly increasing, each below ``numel``), or :class:`ProtocolViolation`."""
    chunks, nnz = _chunks(numel), offsets.numel()
    if (
        counts.dtype != torch.int32
        or tuple(counts.shape) != (chunks,)
        or offsets.dtype != torch.int16
        or tuple(offsets.shape) != (nnz,)
    ):
        raise ProtocolViolation(f"aggregate {name!r}: positions have the wrong dtypes or shapes")
    if bool(counts.lt(0).any()) or int(counts.sum()) != nnz:
        raise ProtocolViolation(f"aggregate {name!r}: chunk counts do not add up to its values")
    chunk_of = torch.repeat_interleave(torch.arange(chunks, dtype=torch.int64), counts.long())
    positions = chunk_of * _CHUNK + offsets.long() + _OFFSET_BIAS
    if nnz and (int(positions[-1]) >= numel or not bool(positions[1:].gt(positions[:-1]).all())):
        raise ProtocolViolation(f"aggregate {name!r}: positions out of order or out of range")
    return positions


def _decode_rounded(
    quantiser: Int8Codec | PackedQuantCodec, spec: TensorSpec, parts: dict[str, torch.Tensor]
) -> torch.Tensor:
    name, numel = spec.name, math.prod(spec.shape)
    counts, offsets = parts.pop(f"{name}/counts", None), parts.pop(f"{name}/offsets", None)
    if counts is not None or offsets is not None:
        if counts is None or offsets is None:
            raise ProtocolViolation(f"{quantiser.name} aggregate {name!r} is half sparse")
        nnz = offsets.numel()
        if not _rounded_sparse_is_smaller(quantiser, nnz, numel):
            raise ProtocolViolation(
                f"{quantiser.name} aggregate {name!r} is sparse where dense is canonical"
            )
        positions = _positions(name, counts, offsets, numel)
        values = _rounded_parts(quantiser, TensorSpec(name, (nnz,), "float32"), parts)
        flat = torch.zeros(numel, dtype=torch.float32)
        flat.index_copy_(0, positions, values)
        return flat.reshape(spec.shape)
    # (a dense rounding cannot be checked for canonical form here: values that rounded to
    # zero were stored all the same; the head's recomputed hash binds the form)
    return _rounded_parts(quantiser, spec, parts)


def _rounded_parts(
    quantiser: Int8Codec | PackedQuantCodec, spec: TensorSpec, parts: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The values of ``spec`` that ``quantiser``'s parts in ``parts`` (taken out) give."""
    name, found = spec.name, {}
    for part, (shape, dtype) in quantiser.layout(spec).items():
        value = parts.pop(f"{name}/{part}", None)
        if value is None:
            raise ProtocolViolation(
                f"{quantiser.name} aggregate lacks the {part!r} part of {name!r}"
            )
        if value.dtype != dtype or tuple(value.shape) != shape:
            raise ProtocolViolation(
                f"{quantiser.name} aggregate {name!r}: parts have the wrong dtypes or shapes"
            )
        found[part] = value
    return quantiser.decode(spec, found)
