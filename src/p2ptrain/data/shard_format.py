"""One shard file, format ``p2ptrain-shard/1`` (docs/data.md).

A shard file is a safetensors file (an 8-byte little-endian header length, a JSON header,
then the tensors' bytes; never pickle) holding the samples of one shard as columns
(:mod:`p2ptrain.data.columns`). Per column ``K``: a *stacked* column is the tensor ``K`` of
shape ``[samples, *row shape]``; a *ragged* column is ``K.values`` (the rows concatenated on
dim 0) and ``K.offsets`` (int64 ``[samples + 1]``). The header's ``__metadata__`` holds
``format``, ``samples``, ``rows`` (``tensor``, ``tuple`` or ``dict``) and ``columns``: a
JSON list of ``{"key", "kind", "dtype", "shape"}`` in column order (``shape`` is a row's, with
``null`` for a ragged column's first dimension).

An integer column is stored in the narrowest of uint8, int8, uint16, int16, uint32, int32,
int64, uint64 that holds its values (token ids take 1 or 2 bytes each) and reads back as its
``dtype``. The bytes depend on the samples only: the header is compact JSON in a fixed order,
padded with spaces to a multiple of 8 bytes, and the tensors are laid out by decreasing item
size, then name -- so every tensor is aligned and a shard's SHA-256 is stable.

Reading treats the file as untrusted: the header is bounded, every length and offset is
checked before anything is sliced, and any fault raises :class:`MalformedShard` naming the
shard, the byte offset or sample and the problem.
"""

from __future__ import annotations

import json
import math
import mmap
import operator
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import msgspec
import numpy as np
import torch

from p2ptrain.data.columns import (
    DTYPES,
    INTEGER_DTYPES,
    ROW_KINDS,
    Column,
    Shape,
    columns_from_samples,
)
from p2ptrain.errors import LocalError

__all__ = [
    "SHARD_FORMAT",
    "ColumnInfo",
    "EncodedShard",
    "MalformedShard",
    "ShardRows",
    "decode_shard",
    "encode_columns",
    "encode_shard",
    "open_shard",
]

SHARD_FORMAT = "p2ptrain-shard/1"
#: The largest JSON header a shard may have.
MAX_HEADER_BYTES = 1 << 20
MAX_COLUMNS = 1024
MAX_SAMPLES = 1 << 40
_MAX_DIMS = 16

#: The safetensors dtype of stored NumPy data (a bfloat16 column's int16 bits are BF16).
_CODES = {numpy: code for name, (numpy, code) in DTYPES.items() if name != "bfloat16"}
_CODE_DTYPE = {code: name for name, (_, code) in DTYPES.items()}
_CODE_NUMPY = {code: numpy for numpy, code in DTYPES.values()}


class MalformedShard(LocalError):
    """A shard file breaks the format; ``where`` is ``byte N`` or ``sample N``."""

    def __init__(self, shard: str, where: str, problem: str) -> None:
        super().__init__(
            f"shard {shard!r:.100} is malformed at {where}: {problem}. The preparer's shard "
            "is damaged; re-run `p2ptrain data prepare` (or fetch the shard again)"
        )
        self.shard = shard
        self.where = where
        self.problem = problem


@dataclass(frozen=True)
class ColumnInfo:
    """How one column is stored: ``kind`` stacked or ragged, ``dtype`` as read, ``shape`` of
    a row (``None`` first when ragged), ``stored`` the dtype of its bytes in the file."""

    key: str
    kind: Literal["stacked", "ragged"]
    dtype: str
    shape: Shape
    stored: str

    def to_json(self) -> dict[str, object]:
        return {"key": self.key, "kind": self.kind, "dtype": self.dtype, "shape": self.shape}


@dataclass(frozen=True, eq=False)
class EncodedShard:
    """A shard file as its header and the arrays that follow it, in file order."""

    header: bytes
    arrays: tuple[np.ndarray, ...]
    rows: str
    samples: int
    columns: tuple[ColumnInfo, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(array.nbytes for array in self.arrays)

    def pieces(self) -> Iterator[memoryview]:
        """The file's bytes in order, without copying the arrays."""
        yield memoryview(self.header)
        for array in self.arrays:
            if array.nbytes:
                yield memoryview(array.reshape(-1).view(np.uint8).data)

    def tobytes(self) -> bytes:
        return b"".join(self.pieces())


def _stored(column: Column) -> np.ndarray:
    return np.ascontiguousarray(column.data.astype(column.stored_dtype(), copy=False))


def _tensor_names(key: str, kind: str) -> tuple[str, ...]:
    return (key,) if kind == "stacked" else (f"{key}.values", f"{key}.offsets")


def encode_columns(rows: str, columns: Sequence[Column]) -> EncodedShard:
    """The shard file of ``columns`` (equal lengths, keys in column order)."""
    samples = len(columns[0])
    tensors: list[tuple[str, str, np.ndarray]] = []
    infos = []
    for column in columns:
        stored = _stored(column)
        code = "BF16" if column.dtype == "bfloat16" else _CODES[stored.dtype.str]
        kind: Literal["stacked", "ragged"] = "stacked" if column.offsets is None else "ragged"
        infos.append(
            ColumnInfo(column.key, kind, column.dtype, column.row_shape, _CODE_DTYPE[code])
        )
        names = _tensor_names(column.key, kind)
        tensors.append((names[0], code, stored))
        if column.offsets is not None:
            offsets = np.ascontiguousarray(column.offsets.astype("<i8", copy=False))
            tensors.append((names[1], "I64", offsets))
    every = [name for name, _, _ in tensors]
    if len(set(every)) != len(every) or "__metadata__" in every:
        raise LocalError(
            f"the columns {[c.key for c in columns]} give clashing tensor names {every}; "
            "rename the column whose name ends in .values or .offsets (or is __metadata__)"
        )
    tensors.sort(key=lambda item: (-item[2].dtype.itemsize, item[0]))
    metadata = {
        "format": SHARD_FORMAT,
        "samples": str(samples),
        "rows": rows,
        "columns": json.dumps([info.to_json() for info in infos], separators=(",", ":")),
    }
    header: dict[str, object] = {"__metadata__": metadata}
    start = 0
    for name, code, array in tensors:
        end = start + array.nbytes
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [start, end]}
        start = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return EncodedShard(
        len(text).to_bytes(8, "little") + text,
        tuple(array for _, _, array in tensors),
        rows,
        samples,
        tuple(infos),
    )


def encode_shard(samples: Sequence[object]) -> bytes:
    """The shard file of ``samples`` (see the module docstring); a LocalError names the
    sample and key that break the first sample's structure or dtype."""
    rows, columns = columns_from_samples(samples)
    return encode_columns(rows, columns).tobytes()


# -- reading --------------------------------------------------------------------------------


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]


class _ColumnSpec(msgspec.Struct, forbid_unknown_fields=True):
    key: str
    kind: Literal["stacked", "ragged"]
    dtype: str
    shape: list[int | None]


_Fault = Callable[[str, str], MalformedShard]


class _Tensor(NamedTuple):
    """A tensor of a shard file: its data, its file offset and its safetensors dtype."""

    array: np.ndarray
    at: int
    code: str


@dataclass(frozen=True, eq=False)
class _Stored:
    info: ColumnInfo
    data: np.ndarray
    offsets: np.ndarray | None


class ShardRows:
    """The samples of one shard file: ``rows[i]`` is sample ``i`` as encoded -- a tensor,
    a tuple of tensors or a dict of tensors (numbers come back as 0-d tensors, integer
    columns in their own dtype). Each sample is a fresh copy the caller may modify."""

    def __init__(
        self, shard: str, rows: str, samples: int, columns: Sequence[_Stored], nbytes: int
    ) -> None:
        self.shard = shard
        self.rows = rows
        self.nbytes = nbytes
        self._samples = samples
        self._columns = tuple(columns)
        self.columns: tuple[ColumnInfo, ...] = tuple(column.info for column in columns)

    def __len__(self) -> int:
        return self._samples

    def __iter__(self) -> Iterator[object]:
        return (self[i] for i in range(self._samples))

    def __getitem__(self, index: int) -> object:
        i = operator.index(index)
        if i < 0:
            i += self._samples
        if not 0 <= i < self._samples:
            raise IndexError(f"sample {index} of shard {self.shard!r}, which has {len(self)}")
        parts = [self._part(column, i) for column in self._columns]
        if self.rows == "tensor":
            return parts[0]
        if self.rows == "tuple":
            return tuple(parts)
        return {column.info.key: part for column, part in zip(self._columns, parts, strict=True)}

    @staticmethod
    def _part(column: _Stored, i: int) -> torch.Tensor:
        if column.offsets is None:
            row = column.data[i]
        else:
            row = column.data[int(column.offsets[i]) : int(column.offsets[i + 1])]
        array = np.array(row, dtype=DTYPES[column.info.dtype][0])
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if column.info.dtype == "bfloat16" else tensor


def open_shard(path: str | os.PathLike[str], *, shard: str) -> ShardRows:
    """The samples of the shard file at ``path`` (memory-mapped: rows are read when asked
    for); MalformedShard names ``shard`` and the fault."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < 8:
            raise MalformedShard(shard, "byte 0", f"the file has {size} bytes; too short")
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    return _parse(np.frombuffer(mapped, dtype=np.uint8), shard)


def decode_shard(data: bytes | bytearray | memoryview, *, shard: str) -> ShardRows:
    """The samples of a shard file held in memory (not copied)."""
    return _parse(np.frombuffer(data, dtype=np.uint8), shard)


def _parse(buffer: np.ndarray, shard: str) -> ShardRows:
    def fault(where: str, problem: str) -> MalformedShard:
        return MalformedShard(shard, where, problem)

    size = int(buffer.shape[0])
    if size < 8:
        raise fault("byte 0", f"the file has {size} bytes; too short")
    length = int.from_bytes(buffer[:8].tobytes(), "little")
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise fault(
            "byte 0",
            f"the header length {length} does not fit (the file has {size} bytes and a "
            f"header is at most {MAX_HEADER_BYTES}); this is not a shard file",
        )
    try:
        header = msgspec.json.decode(buffer[8 : 8 + length].tobytes(), type=dict[str, msgspec.Raw])
        metadata = msgspec.json.decode(header.pop("__metadata__", b"{}"), type=dict[str, str])
        entries = {name: msgspec.json.decode(raw, type=_Entry) for name, raw in header.items()}
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise fault("byte 8", f"the header is not a safetensors header ({exc})") from None
    if metadata.get("format") != SHARD_FORMAT:
        raise fault(
            "byte 8",
            f"the format is {metadata.get('format')!r:.40}, not {SHARD_FORMAT!r}; this is "
            "not a p2ptrain shard (or was written by another version)",
        )
    rows = metadata.get("rows", "")
    samples_text = metadata.get("samples", "")
    if rows not in ROW_KINDS or not (samples_text.isascii() and samples_text.isdigit()):
        raise fault("byte 8", f"rows {rows!r:.40} or samples {samples_text!r:.40} is invalid")
    samples = int(samples_text)
    if not 1 <= samples <= MAX_SAMPLES:
        raise fault("byte 8", f"samples is {samples}; a shard holds 1 to {MAX_SAMPLES}")
    try:
        specs = msgspec.json.decode(metadata.get("columns", ""), type=list[_ColumnSpec])
    except msgspec.DecodeError as exc:
        raise fault("byte 8", f"the columns description is invalid ({exc})") from None
    _check_columns(rows, specs, fault)
    arrays = _tensors(buffer, 8 + length, entries, fault)
    columns = []
    expected: set[str] = set()
    for spec in specs:
        names = _tensor_names(spec.key, spec.kind)
        expected.update(names)
        missing = [name for name in names if name not in arrays]
        if missing:
            raise fault("byte 8", f"column {spec.key!r:.80} has no tensor {missing[0]!r:.80}")
        columns.append(_column(spec, [arrays[name] for name in names], samples, fault))
    extra = sorted(set(arrays) - expected)
    if extra:
        raise fault("byte 8", f"the tensor {extra[0]!r:.80} belongs to no column")
    return ShardRows(shard, rows, samples, columns, size)


def _check_columns(rows: str, specs: list[_ColumnSpec], fault: _Fault) -> None:
    if not 1 <= len(specs) <= MAX_COLUMNS:
        raise fault("byte 8", f"{len(specs)} columns; a shard has 1 to {MAX_COLUMNS}")
    keys = [spec.key for spec in specs]
    if rows == "dict":
        if not all(keys) or keys != sorted(set(keys)):
            raise fault("byte 8", "the column keys of dict rows are not sorted and unique")
    elif keys != [str(i) for i in range(len(specs))] or (rows == "tensor" and len(keys) > 1):
        raise fault("byte 8", f"{rows} rows cannot have the columns {keys!r:.100}")
    for spec in specs:
        ragged = spec.kind == "ragged"
        sizes = spec.shape[1:] if ragged else spec.shape
        if (
            spec.dtype not in DTYPES
            or len(spec.shape) > _MAX_DIMS
            or (ragged and (not spec.shape or spec.shape[0] is not None))
            or not all(isinstance(size, int) and size >= 0 for size in sizes)
        ):
            raise fault(
                "byte 8",
                f"column {spec.key!r:.80} has an invalid dtype {spec.dtype!r:.20} or shape "
                f"{spec.shape!r:.80} for a {spec.kind} column",
            )


def _tensors(
    buffer: np.ndarray, base: int, entries: dict[str, _Entry], fault: _Fault
) -> dict[str, _Tensor]:
    """Every tensor of the header as (array view, file offset), after checking that the
    tensors tile the data region exactly."""
    available = int(buffer.shape[0]) - base
    found: dict[str, _Tensor] = {}
    position = 0
    for name, entry in sorted(entries.items(), key=lambda item: item[1].data_offsets):
        begin, end = entry.data_offsets
        where = f"byte {base + max(begin, 0)}"
        if entry.dtype not in _CODE_NUMPY or len(entry.shape) > _MAX_DIMS + 1:
            raise fault(where, f"tensor {name!r:.80} has dtype {entry.dtype!r:.20}")
        if any(size < 0 for size in entry.shape):
            raise fault(where, f"tensor {name!r:.80} has the shape {entry.shape}")
        if begin != position or not begin <= end <= available:
            raise fault(
                where,
                f"tensor {name!r:.80} spans bytes {begin}..{end} of the data, which must "
                f"continue at {position} and end by {available} (the file is truncated or "
                "its header damaged)",
            )
        dtype = np.dtype(_CODE_NUMPY[entry.dtype])
        if end - begin != math.prod(entry.shape) * dtype.itemsize:
            raise fault(
                where, f"tensor {name!r:.80} has {end - begin} bytes for shape {entry.shape}"
            )
        array = buffer[base + begin : base + end].view(dtype).reshape(entry.shape)
        found[name] = _Tensor(array, base + begin, entry.dtype)
        position = end
    if position != available:
        raise fault(
            f"byte {base + position}",
            f"{available - position} bytes follow the last tensor; a shard ends with its data",
        )
    return found


def _column(spec: _ColumnSpec, tensors: list[_Tensor], samples: int, fault: _Fault) -> _Stored:
    (data, at, code), offsets = tensors[0], tensors[1] if len(tensors) > 1 else None
    integer = spec.dtype in INTEGER_DTYPES and _CODE_DTYPE[code] in INTEGER_DTYPES
    if not integer and code != DTYPES[spec.dtype][1]:
        raise fault(f"byte {at}", f"column {spec.key!r:.80} ({spec.dtype}) is stored as {code}")
    info = ColumnInfo(spec.key, spec.kind, spec.dtype, tuple(spec.shape), _CODE_DTYPE[code])
    if offsets is None:
        if data.shape[1:] != tuple(spec.shape):
            raise fault(f"byte {at}", f"column {spec.key!r:.80} has rows of {list(data.shape[1:])}")
        if data.shape[0] != samples:
            raise fault(
                f"sample {min(data.shape[0], samples)}",
                f"column {spec.key!r:.80} has {data.shape[0]} rows; the shard has {samples}",
            )
        return _Stored(info, data, None)
    ends, ends_at, ends_code = offsets
    if data.ndim != len(spec.shape) or data.shape[1:] != tuple(spec.shape[1:]):
        raise fault(f"byte {at}", f"column {spec.key!r:.80} has values of {list(data.shape)}")
    if ends_code != "I64" or ends.shape != (samples + 1,):
        raise fault(
            f"byte {ends_at}",
            f"the offsets of column {spec.key!r:.80} are {ends_code} "
            f"{list(ends.shape)}, not I64 [{samples + 1}]",
        )
    decreasing = np.flatnonzero(ends[1:] < ends[:-1])
    beyond = np.flatnonzero(ends[1:] > data.shape[0])
    if ends[0] != 0:
        raise fault("sample 0", f"the offsets of column {spec.key!r:.80} start at {ends[0]}")
    if decreasing.size:
        i = int(decreasing[0])
        raise fault(
            f"sample {i}",
            f"the offsets of column {spec.key!r:.80} decrease ({ends[i]} to {ends[i + 1]})",
        )
    if beyond.size or ends[-1] != data.shape[0]:
        i = int(beyond[0]) if beyond.size else samples - 1
        raise fault(
            f"sample {i}",
            f"the offsets of column {spec.key!r:.80} end at {ends[i + 1]}, but its values "
            f"hold {data.shape[0]} rows",
        )
    return _Stored(info, data, ends)
