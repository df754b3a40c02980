"""Model state dicts to safetensors bytes and back, never pickle (DESIGN §1.6, §3).

Weights, updates and optimizer state travel between peers as `safetensors`_ blobs::

    8 bytes   little-endian length N of the header
    N bytes   JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]},
                           "__metadata__": {"p2ptrain.schema": <schema hash>}}
              padded with spaces so the data starts 8-byte aligned
    rest      the tensors' raw little-endian bytes, back to back, no gaps

:func:`encode_state_dict` writes exactly the bytes the official ``safetensors`` library writes
for the same tensors and metadata (same header order, same JSON, same padding and layout), in a
single copy. Encoding is deterministic, so two honest machines produce the same blob id.

:func:`decode_state_dict` parses the header itself, validates every field strictly (the same
rules as the official reader, plus ours) and raises only :class:`ProtocolViolation` on bad
bytes. Each returned tensor owns fresh, aligned, writable CPU memory: nothing aliases the input
buffer, so aggregation may work in place.

The *model schema* is the sorted list of (name, shape, dtype) of the parameters; its hash
(:func:`schema_hash`) goes into signed experiment manifests, and every blob carries it in its
metadata, checked on decode.

.. _safetensors: https://github.com/huggingface/safetensors
"""

from __future__ import annotations

import hashlib
import itertools
import math
import mmap
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Final, NamedTuple, TypeAlias

import msgspec
import numpy as np
import torch

from p2ptrain.core.spool import BlobSpool, SpooledBlob
from p2ptrain.errors import LocalError, ProtocolViolation

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MAX_HEADER_BYTES",
    "SCHEMA_METADATA_KEY",
    "SUPPORTED_DTYPES",
    "BlobLayout",
    "PartWriter",
    "Schema",
    "StateLayout",
    "TensorSlot",
    "TensorSpec",
    "blank_state_blob",
    "decode_state_dict",
    "encode_state_dict",
    "read_layout",
    "schema_hash",
    "schema_of",
    "state_layout",
    "state_views",
    "uint8_alias",
    "write_state_dict",
]

SCHEMA_METADATA_KEY: Final = "p2ptrain.schema"
"""Header metadata key that carries the blob's schema hash."""

MAX_HEADER_BYTES: Final = 16 * 1024 * 1024
"""Largest JSON header we parse. Real headers take ~100 bytes a tensor (1 MB for 10,000
tensors); the official reader allows 100 MB, which from a peer would cost seconds of CPU and
gigabytes of memory to parse."""

DEFAULT_MAX_BYTES: Final = 64 * 1024**3
"""Default size limit of a whole blob; callers should pass the size they expect."""

MAX_NDIM: Final = 32
"""Most dimensions a tensor may have."""

_MAX_ELEMENTS: Final = 2**62  # product of the non-zero dims; keeps every stride in int64

# (torch dtype, safetensors code). The order is the official writer's layout order: wider
# dtypes first, so every tensor's offset is a multiple of its item size.
_DTYPE_TABLE: Final[tuple[tuple[torch.dtype, str], ...]] = (
    (torch.int64, "I64"),
    (torch.float64, "F64"),
    (torch.float32, "F32"),
    (torch.int32, "I32"),
    (torch.bfloat16, "BF16"),
    (torch.float16, "F16"),
    (torch.int16, "I16"),
    (torch.int8, "I8"),
    (torch.uint8, "U8"),
    (torch.bool, "BOOL"),
)
SUPPORTED_DTYPES: Final = frozenset(dtype for dtype, _ in _DTYPE_TABLE)
_CODE_OF: Final = {dtype: code for dtype, code in _DTYPE_TABLE}
_DTYPE_OF_CODE: Final = {code: dtype for dtype, code in _DTYPE_TABLE}
_LAYOUT_RANK: Final = {dtype: rank for rank, (dtype, _) in enumerate(_DTYPE_TABLE)}


class TensorSpec(msgspec.Struct, frozen=True):
    """One parameter of a model schema. The field order is part of the schema hash."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch's name without the "torch." prefix: "float32", "bfloat16", ...

    def describe(self) -> str:
        """``(10, 64) float32``: shape and dtype as error messages show them."""
        return f"{self.shape} {self.dtype}"


Schema: TypeAlias = tuple[TensorSpec, ...]

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class _HeaderEntry(msgspec.Struct, forbid_unknown_fields=True):
    """One tensor's entry in a safetensors JSON header, as a peer sent it."""

    dtype: str
    shape: Annotated[list[_NonNegative], msgspec.Meta(max_length=MAX_NDIM)]
    data_offsets: tuple[_NonNegative, _NonNegative]


class TensorSlot(msgspec.Struct, frozen=True):
    """A validated header entry: where one tensor's bytes lie in the data section (``begin``
    and ``end`` count from the data section's start)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


_HEADER_DECODER: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ENTRY_DECODER: Final = msgspec.json.Decoder(_HeaderEntry)
_METADATA_DECODER: Final = msgspec.json.Decoder(dict[str, str])
_SCHEMA_ENCODER: Final = msgspec.msgpack.Encoder(order="deterministic")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _quote(name: str) -> str:
    """A peer-supplied name, quoted and cut short enough for a log line."""
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------- schema


def schema_of(state_dict: Mapping[str, torch.Tensor]) -> Schema:
    """The model schema of ``state_dict``: one :class:`TensorSpec` per entry, sorted by name."""
    specs = []
    for name, tensor in state_dict.items():
        _check_entry(name, tensor)
        specs.append(TensorSpec(name, tuple(tensor.shape), _dtype_name(tensor.dtype)))
    return tuple(sorted(specs, key=lambda spec: spec.name))


def schema_hash(source: Mapping[str, torch.Tensor] | Iterable[TensorSpec]) -> str:
    """Lowercase hex SHA-256 of the canonical msgpack encoding of the sorted schema.

    ``source`` is a state dict or a schema (any order). This is the "model schema hash" of
    DESIGN §3: stable across processes, machines and library versions.
    """
    if isinstance(source, Mapping):
        return _hash_sorted_schema(schema_of(source))
    return _hash_sorted_schema(_sorted_schema(source))


def _sorted_schema(specs: Iterable[TensorSpec]) -> Schema:
    given = tuple(specs)
    for spec in given:
        if not isinstance(spec, TensorSpec):
            raise LocalError(f"a schema holds TensorSpec records, not {type(spec).__name__}")
    schema = tuple(sorted(given, key=lambda spec: spec.name))
    for before, after in itertools.pairwise(schema):
        if before.name == after.name:
            raise LocalError(f"schema names parameter {_quote(after.name)} twice; drop one")
    return schema


def _hash_sorted_schema(schema: Schema) -> str:
    return hashlib.sha256(_SCHEMA_ENCODER.encode(schema)).hexdigest()


# ---------------------------------------------------------------------------------- encode


def encode_state_dict(state_dict: Mapping[str, torch.Tensor]) -> bytearray:
    """Encode ``state_dict`` as safetensors bytes with its schema hash in the metadata.

    Non-contiguous views are packed, tensors that share storage are written out separately,
    tensors on other devices are copied to the CPU. Raises :class:`LocalError` for dtypes,
    layouts or names that cannot be encoded. The result is byte-identical to what
    ``safetensors.torch.save(state_dict, metadata={SCHEMA_METADATA_KEY: schema_hash(...)})``
    writes, and the same state dict always gives the same bytes.
    """
    tensors, prefix = _laid_out(state_dict)
    data_len = sum(tensor.nbytes for _, tensor in tensors)
    # One buffer for the result; torch's multi-threaded copy_ writes every tensor (packing
    # views, fetching from devices) straight into place, in one pass.
    blob = bytearray(len(prefix) + data_len)
    blob[: len(prefix)] = prefix
    target = (
        torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    )
    position = len(prefix)
    for _, tensor in tensors:
        if tensor.nbytes:
            region = target[position : position + tensor.nbytes]
            region.view(tensor.dtype).view(tensor.shape).copy_(tensor)
        position += tensor.nbytes
    return blob


def write_state_dict(
    state_dict: Mapping[str, torch.Tensor], spool: BlobSpool
) -> bytearray | SpooledBlob:
    """:func:`encode_state_dict`'s bytes, written tensor by tensor into a sink of ``spool``
    (a file, say) instead of one buffer: the blob the sink gives."""
    tensors, prefix = _laid_out(state_dict)
    sink = spool.open(len(prefix) + sum(tensor.nbytes for _, tensor in tensors))
    sink.write(0, prefix)
    position = len(prefix)
    for _, tensor in tensors:
        if tensor.nbytes:
            flat = tensor.cpu().contiguous().reshape(-1).view(torch.uint8)
            sink.write(position, flat.numpy().data)
        position += tensor.nbytes
    return sink.close()


def _laid_out(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[list[tuple[str, torch.Tensor]], bytes]:
    """The entries in safetensors' data order, and the prefix (length and header)."""
    _require_little_endian()
    tensors = sorted(
        ((name, _plain(name, tensor)) for name, tensor in state_dict.items()),
        key=lambda item: (_LAYOUT_RANK[item[1].dtype], item[0]),
    )
    return tensors, _prefix(tensors, schema_hash(state_dict))


class PartWriter:
    """:func:`encode_state_dict`'s bytes of tensors known only by name, dtype and shape
    when the writing starts, each written piece by piece (``write``: elements from an
    offset) into a sink of ``spool``; :meth:`close` gives the blob. Every element must be
    written (unwritten bytes stay zero)."""

    def __init__(
        self, parts: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], spool: BlobSpool
    ) -> None:
        _require_little_endian()
        shapes = sorted(
            (
                (name, torch.empty(shape, dtype=dtype, device="meta"))
                for name, (dtype, shape) in parts.items()
            ),
            key=lambda item: (_LAYOUT_RANK[item[1].dtype], item[0]),
        )
        schema = [TensorSpec(name, tuple(t.shape), _dtype_name(t.dtype)) for name, t in shapes]
        prefix = _prefix(shapes, _hash_sorted_schema(_sorted_schema(schema)))
        self._where: dict[str, tuple[int, torch.dtype]] = {}
        position = len(prefix)
        for name, tensor in shapes:
            self._where[name] = (position, tensor.dtype)
            position += tensor.nbytes
        self._sink = spool.open(position)
        self._sink.write(0, prefix)

    def write(self, name: str, first: int, values: torch.Tensor) -> None:
        """Write ``values`` (the part's dtype) as elements ``first ..`` of part ``name``."""
        position, dtype = self._where[name]
        if values.dtype != dtype:
            raise LocalError(f"part {name!r} is {dtype}, not {values.dtype}")
        if values.numel():
            flat = values.cpu().contiguous().reshape(-1).view(torch.uint8)
            self._sink.write(position + first * dtype.itemsize, flat.numpy().data)

    def close(self) -> bytearray | SpooledBlob:
        return self._sink.close()


class StateLayout(NamedTuple):
    """Where a float32 state dict's parts lie in its blob: the prefix (length and header),
    the blob's size, and each entry's byte offset and shape, by name (sorted)."""

    prefix: bytes
    size: int
    entries: dict[str, tuple[int, tuple[int, ...]]]


def state_layout(schema: Iterable[TensorSpec]) -> StateLayout:
    """The layout of :func:`encode_state_dict`'s blob of any state dict of ``schema``
    (float32 entries): entries in sorted-name order, so the data section is their
    flattening (:func:`~p2ptrain.aggregate.exact.flatten`'s order)."""
    _require_little_endian()
    specs = _sorted_schema(schema)
    for spec in specs:
        if spec.dtype != "float32":
            raise LocalError(f"a float32 state blob holds float32 tensors; {spec.name!r} is not")
    shapes = [
        (spec.name, torch.empty(spec.shape, dtype=torch.float32, device="meta")) for spec in specs
    ]
    prefix = _prefix(shapes, _hash_sorted_schema(specs))
    entries: dict[str, tuple[int, tuple[int, ...]]] = {}
    position = len(prefix)
    for name, tensor in shapes:
        entries[name] = (position, tuple(tensor.shape))
        position += tensor.nbytes
    return StateLayout(prefix, position, entries)


def blank_state_blob(schema: Iterable[TensorSpec]) -> tuple[bytearray, dict[str, torch.Tensor]]:
    """The blob of a state dict of ``schema`` (float32 entries) before its values are
    written, and its tensors as views into the blob's bytes, by name (sorted): once they
    are filled, the blob is byte for byte ``encode_state_dict`` of them, with no copy (see
    :func:`state_layout`). The views keep the blob alive; whoever shares the blob must not
    write to them afterwards."""
    layout = state_layout(schema)
    blob = bytearray(layout.size)
    blob[: len(layout.prefix)] = layout.prefix
    return blob, state_views(blob, layout)


def state_views(buffer: bytearray | mmap.mmap, layout: StateLayout) -> dict[str, torch.Tensor]:
    """The float32 tensors of ``layout`` as views of ``buffer`` (a writable buffer holding
    the blob: a ``bytearray``, a private file mapping)."""
    views: dict[str, torch.Tensor] = {}
    for name, (position, shape) in layout.entries.items():
        count = math.prod(shape)
        if count:
            flat = torch.frombuffer(buffer, dtype=torch.float32, offset=position, count=count)
        else:
            flat = torch.empty(0, dtype=torch.float32)
        views[name] = flat.view(shape)
    return views


def _prefix(tensors: list[tuple[str, torch.Tensor]], schema: str) -> bytes:
    """Header length and JSON header for ``tensors``, laid out back to back in this order."""
    header: dict[str, object] = {"__metadata__": {SCHEMA_METADATA_KEY: schema}}
    offset = 0
    for name, tensor in tensors:
        header[name] = {
            "dtype": _CODE_OF[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    encoded = msgspec.json.encode(header)
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return len(encoded).to_bytes(8, "little") + encoded


def _check_entry(name: object, tensor: object) -> None:
    if not isinstance(name, str):
        raise LocalError(f"state dict keys must be str, got {type(name).__name__} {name!r}")
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise LocalError(
                f"tensor name {_quote(name)} is not valid text ({exc}); rename it"
            ) from exc
    if not isinstance(tensor, torch.Tensor):
        raise LocalError(f"{_quote(name)} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(sorted(_dtype_name(dtype) for dtype in SUPPORTED_DTYPES))
        raise LocalError(
            f"tensor {_quote(name)} has dtype {_dtype_name(tensor.dtype)}, which p2ptrain does "
            f"not encode; convert it (for example with .float()) to one of: {supported}"
        )


def _plain(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached from autograd, after checking that it can be encoded at all."""
    _check_entry(name, tensor)
    if name == "__metadata__":
        raise LocalError("'__metadata__' is reserved by safetensors; rename that tensor")
    if tensor.layout != torch.strided:
        raise LocalError(f"tensor {_quote(name)} is {tensor.layout}; call .to_dense() first")
    if tensor.is_meta:
        raise LocalError(f"tensor {_quote(name)} is on the meta device and holds no data")
    plain = tensor.detach()
    if type(plain) is not torch.Tensor:
        raise LocalError(
            f"tensor {_quote(name)} is a {type(plain).__name__}; gather it into a plain "
            "torch.Tensor (e.g. .full_tensor()) before encoding"
        )
    return plain


class _ArrayInterface:
    """Hands numpy a raw address (numpy's array interface), keeping its owner alive."""

    def __init__(self, view: memoryview) -> None:
        self.owner = view
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0
        self.__array_interface__ = {
            "version": 3,
            "shape": (len(view),),
            "typestr": "|u1",
            "data": (address, False),
        }


def uint8_alias(buffer: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over ``buffer``'s memory, without a copy, even when it is read-only.

    torch wraps only writable buffers (and warns about read-only ones), so the address goes
    through numpy's array interface instead. The tensor is only ever read from.
    """
    return torch.from_numpy(np.asarray(_ArrayInterface(memoryview(buffer))))


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise LocalError("safetensors blobs are little-endian; big-endian hosts are unsupported")


# ---------------------------------------------------------------------------------- decode


def decode_state_dict(
    data: bytes | bytearray | memoryview,
    *,
    expected_schema: str | Iterable[TensorSpec] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> dict[str, torch.Tensor]:
    """Decode safetensors bytes from a peer into a state dict (keys sorted by name).

    Raises :class:`ProtocolViolation`, and nothing else, for any bad bytes: malformed or
    oversized header, offsets that overlap, leave gaps or run out of bounds, unknown dtypes,
    a metadata schema hash that does not match the tensors, or a schema other than
    ``expected_schema`` (a schema hash, or the schema itself for a message that names the
    first differing parameter). Every returned tensor owns fresh writable CPU memory,
    independent of ``data``. Raises :class:`LocalError` only for bad arguments.
    """
    _require_little_endian()
    view = _byte_view(data)
    expected = None if expected_schema is None else _expected(expected_schema)
    base, slots, metadata = _parse_layout(view, max_bytes)
    schema = tuple(
        sorted(
            (TensorSpec(slot.name, slot.shape, _dtype_name(slot.dtype)) for slot in slots),
            key=lambda spec: spec.name,
        )
    )
    actual = _hash_sorted_schema(schema)
    _check_metadata(metadata, actual)
    if expected is not None:
        _check_expected(expected, schema, actual)
    source = uint8_alias(view)  # only read from
    tensors = {slot.name: _copy_tensor(source, base, slot) for slot in slots}
    return {name: tensors[name] for name in sorted(tensors)}


def _byte_view(data: object) -> memoryview:
    try:
        view = memoryview(data)  # type: ignore[arg-type]
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as exc:
        raise LocalError(
            f"decode_state_dict takes bytes or a contiguous buffer ({exc}); pass bytes(data)"
        ) from None


def _parse_layout(
    view: memoryview, max_bytes: int
) -> tuple[int, list[TensorSlot], dict[str, str] | None]:
    """Validate the header; return where data starts, the tensor slots and the metadata."""
    return _parse_prefix(
        lambda offset, length: view[offset : offset + length], len(view), max_bytes
    )


def _parse_prefix(
    read: Callable[[int, int], bytes | bytearray | memoryview], size: int, max_bytes: int
) -> tuple[int, list[TensorSlot], dict[str, str] | None]:
    """:func:`_parse_layout` of a blob of ``size`` bytes whose bytes ``read(offset, length)``
    returns: only the length field and the header are read."""
    if size > max_bytes:
        raise ProtocolViolation(f"tensor blob is {size} bytes, over the limit of {max_bytes}")
    if size < 8:
        raise ProtocolViolation(f"tensor blob is {size} bytes, too short for a safetensors file")
    header_len = int.from_bytes(read(0, 8), "little")
    if header_len > MAX_HEADER_BYTES or header_len > size - 8:
        raise ProtocolViolation(
            f"safetensors header claims {header_len} bytes; the blob has {size - 8} after the "
            f"length field and the limit is {MAX_HEADER_BYTES}"
        )
    try:
        raw_entries = _HEADER_DECODER.decode(read(8, header_len))
        raw_metadata = raw_entries.pop("__metadata__", None)
        metadata = None if raw_metadata is None else _METADATA_DECODER.decode(raw_metadata)
        entries = {name: _ENTRY_DECODER.decode(raw) for name, raw in raw_entries.items()}
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolViolation(f"malformed safetensors header: {exc}") from None
    slots = [_slot(name, entry) for name, entry in entries.items()]
    _check_tiling(slots, size - 8 - header_len)
    return 8 + header_len, slots, metadata


class BlobLayout(NamedTuple):
    """Where a validated safetensors blob keeps each tensor: the data section's offset in
    the blob, and every tensor's slot, by name (sorted)."""

    data_start: int
    slots: dict[str, TensorSlot]


def read_layout(
    read: Callable[[int, int], bytes | bytearray | memoryview],
    size: int,
    *,
    expected_schema: str | Iterable[TensorSpec] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> BlobLayout:
    """The layout of a blob from a peer of ``size`` bytes, reading only its header through
    ``read(offset, length)``: every check of :func:`decode_state_dict` that does not look
    at tensor data (a ``bool`` tensor's bytes are the caller's to check), so a reader can
    then fetch any tensor's bytes by range. Raises :class:`ProtocolViolation` for bad bytes."""
    _require_little_endian()
    expected = None if expected_schema is None else _expected(expected_schema)
    data_start, slots, metadata = _parse_prefix(read, size, max_bytes)
    schema = tuple(
        sorted(
            (TensorSpec(slot.name, slot.shape, _dtype_name(slot.dtype)) for slot in slots),
            key=lambda spec: spec.name,
        )
    )
    actual = _hash_sorted_schema(schema)
    _check_metadata(metadata, actual)
    if expected is not None:
        _check_expected(expected, schema, actual)
    return BlobLayout(data_start, {slot.name: slot for slot in sorted(slots, key=lambda s: s.name)})


def _slot(name: str, entry: _HeaderEntry) -> TensorSlot:
    dtype = _DTYPE_OF_CODE.get(entry.dtype)
    if dtype is None:
        raise ProtocolViolation(f"tensor {_quote(name)} has unsupported dtype {entry.dtype!r}")
    if math.prod(max(dim, 1) for dim in entry.shape) > _MAX_ELEMENTS:
        raise ProtocolViolation(f"tensor {_quote(name)} has an absurd shape")
    begin, end = entry.data_offsets
    if end < begin or end - begin != math.prod(entry.shape) * dtype.itemsize:
        raise ProtocolViolation(
            f"tensor {_quote(name)}: data_offsets [{begin}, {end}] do not fit shape "
            f"{entry.shape} of {entry.dtype}"
        )
    return TensorSlot(name, dtype, tuple(entry.shape), begin, end)


def _check_tiling(slots: list[TensorSlot], data_len: int) -> None:
    """The tensors must cover the data section exactly: no gaps, overlaps or trailing bytes."""
    position = 0
    for slot in sorted(slots, key=lambda slot: (slot.begin, slot.end)):
        if slot.begin != position:
            raise ProtocolViolation(
                f"tensor {_quote(slot.name)} starts at data byte {slot.begin}, expected "
                f"{position}: tensor data overlaps or leaves a gap"
            )
        position = slot.end
    if position != data_len:
        raise ProtocolViolation(
            f"tensors cover {position} data bytes but the blob carries {data_len}"
        )


def _check_metadata(metadata: dict[str, str] | None, actual: str) -> None:
    claimed = (metadata or {}).get(SCHEMA_METADATA_KEY)
    if claimed is None:
        raise ProtocolViolation(
            f"tensor blob has no {SCHEMA_METADATA_KEY!r} metadata; peers must send blobs "
            "written by p2ptrain's encode_state_dict"
        )
    if claimed != actual:
        raise ProtocolViolation(
            f"tensor blob metadata claims schema {_quote(claimed)} but its tensors have "
            f"schema {actual}: the header was tampered with"
        )


def _expected(expected: str | Iterable[TensorSpec]) -> tuple[str, Schema | None]:
    """The expected schema hash, and the schema itself when the caller gave it."""
    if not isinstance(expected, str):
        schema = _sorted_schema(expected)
        return _hash_sorted_schema(schema), schema
    if len(expected) != 64 or expected.strip("0123456789abcdef"):
        raise LocalError(
            f"expected_schema {expected!r} is not a lowercase hex SHA-256; pass schema_hash(...)"
        )
    return expected, None


def _check_expected(expected: tuple[str, Schema | None], schema: Schema, actual: str) -> None:
    expected_hash, expected_schema = expected
    if expected_hash == actual:
        return
    detail = (
        "the sender trains a different model or revision"
        if expected_schema is None
        else _first_difference(expected_schema, schema)
    )
    raise ProtocolViolation(
        f"tensor schema mismatch: expected schema {expected_hash}, got {actual}; {detail}"
    )


def _first_difference(expected: Schema, actual: Schema) -> str:
    """Names the first parameter (by name) where two different schemas disagree."""
    want = {spec.name: spec for spec in expected}
    have = {spec.name: spec for spec in actual}
    for name in sorted(want.keys() | have.keys()):
        wanted, got = want.get(name), have.get(name)
        if got is None and wanted is not None:
            return f"parameter {_quote(name)} is missing (expected {wanted.describe()})"
        if wanted is None and got is not None:
            return f"unexpected parameter {_quote(name)} ({got.describe()})"
        if wanted != got and wanted is not None and got is not None:
            return (
                f"parameter {_quote(name)}: expected shape {wanted.describe()}, "
                f"got {got.describe()}"
            )
    return "the schemas differ"  # unreachable for different hashes, kept for safety


def _copy_tensor(source: torch.Tensor, base: int, slot: TensorSlot) -> torch.Tensor:
    """One tensor, copied out of ``source`` into its own fresh, aligned CPU storage."""
    nbytes = slot.end - slot.begin
    if nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    flat.copy_(source[base + slot.begin : base + slot.end])  # multi-threaded for big tensors
    if slot.dtype == torch.bool and bool(flat.gt(1).any()):
        raise ProtocolViolation(f"bool tensor {_quote(slot.name)} holds bytes other than 0 and 1")
    return flat.view(slot.dtype).reshape(slot.shape)
