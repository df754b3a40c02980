"""Samples as columns: what a shard file stores (docs/data.md).

Samples in a shard share one structure (their *rows* kind): a tensor (``tensor``), a
tuple/list of them (``tuple``, columns ``"0"``, ``"1"``, ...) or a dict of them with string
keys (``dict``, columns in sorted key order). Python bools, ints and floats become 0-d
bool, int64 and float64 tensors, as in :mod:`p2ptrain.data.shards`; NumPy arrays and scalars
are taken like tensors.

A :class:`Column` holds one column of ``n`` rows, either *stacked* (every row the same
shape: ``data`` is ``[n, *shape]``) or *ragged* (rows differ in their first dimension only:
``data`` holds the rows concatenated on dim 0 and ``offsets`` is int64 ``[n + 1]``, row ``i``
being ``data[offsets[i]:offsets[i + 1]]``). ``dtype`` names the torch dtype a row reads back
as; an integer column's ``data`` may be of any NumPy integer dtype whose values fit it (a
tokenizer's ids arrive as uint8 or uint16), and a bfloat16 column's ``data`` holds the bits
as int16.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from p2ptrain.errors import LocalError

__all__ = [
    "DTYPES",
    "INTEGER_DTYPES",
    "NARROW",
    "NUMPY_DTYPES",
    "ROW_KINDS",
    "Column",
    "Shape",
    "columns_from_samples",
    "concat_columns",
    "merge_shapes",
]

#: Row dtype (torch's name) -> (little-endian NumPy dtype of its data, safetensors dtype).
DTYPES: dict[str, tuple[str, str]] = {
    "bool": ("|b1", "BOOL"),
    "uint8": ("|u1", "U8"),
    "int8": ("|i1", "I8"),
    "uint16": ("<u2", "U16"),
    "int16": ("<i2", "I16"),
    "uint32": ("<u4", "U32"),
    "int32": ("<i4", "I32"),
    "uint64": ("<u8", "U64"),
    "int64": ("<i8", "I64"),
    "float16": ("<f2", "F16"),
    "bfloat16": ("<i2", "BF16"),
    "float32": ("<f4", "F32"),
    "float64": ("<f8", "F64"),
}
INTEGER_DTYPES = frozenset(
    ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")
)
ROW_KINDS = ("tensor", "tuple", "dict")
#: The row dtypes NumPy data may have as it is (bfloat16 is not a NumPy dtype).
NUMPY_DTYPES = frozenset(DTYPES) - {"bfloat16"}
#: Where an integer column is stored: the first of these that holds its values.
NARROW = ("|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<i8", "<u8")

#: A row's shape; ``None`` in the first place for a ragged column.
Shape = tuple[int | None, ...]


@dataclass(frozen=True, eq=False)
class Column:
    """One column of ``len(column)`` rows (see the module docstring)."""

    key: str
    dtype: str
    data: np.ndarray
    offsets: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.data.shape[0]) if self.offsets is None else len(self.offsets) - 1

    @property
    def ragged(self) -> bool:
        return self.offsets is not None

    @property
    def row_shape(self) -> Shape:
        rest = tuple(int(size) for size in self.data.shape[1:])
        return rest if self.offsets is None else (None, *rest)

    def take(self, start: int, stop: int) -> Column:
        """Rows ``start..stop-1`` (views, no copy)."""
        if self.offsets is None:
            return Column(self.key, self.dtype, self.data[start:stop])
        offsets = self.offsets[start : stop + 1]
        base = int(offsets[0])
        return Column(self.key, self.dtype, self.data[base : int(offsets[-1])], offsets - base)

    def stored_dtype(self) -> np.dtype[Any]:
        """The dtype a shard file stores this column's data in: an integer column's
        narrowest that holds its values (see :mod:`p2ptrain.data.shard_format`)."""
        if self.dtype not in INTEGER_DTYPES:
            return np.dtype(DTYPES[self.dtype][0])
        low, high = (int(self.data.min()), int(self.data.max())) if self.data.size else (0, 0)
        return next(
            np.dtype(t) for t in NARROW if np.iinfo(t).min <= low and high <= np.iinfo(t).max
        )

    def row_nbytes(self) -> np.ndarray:
        """Each row's size as stored (:meth:`stored_dtype`'s itemsize per element; 8 more
        per ragged row for its offset), int64 ``[len]``."""
        itemsize = self.stored_dtype().itemsize
        per_item = itemsize * math.prod(self.data.shape[1:])
        if self.offsets is None:
            return np.full(len(self), per_item, np.int64)
        return np.diff(self.offsets).astype(np.int64) * per_item + 8


def merge_shapes(first: Shape, second: Shape) -> Shape | None:
    """The row shape of a column holding rows of both shapes, or None when none can:
    equal shapes stay, shapes that differ in the first dimension only become ragged."""
    if first == second:
        return first
    if len(first) == len(second) >= 1 and first[1:] == second[1:]:
        return (None, *first[1:])
    return None


def _as_ragged(column: Column) -> tuple[np.ndarray, np.ndarray]:
    if column.offsets is not None:
        return column.data, column.offsets
    rows, length = column.data.shape[0], column.data.shape[1]
    values = column.data.reshape(rows * length, *column.data.shape[2:])
    return values, np.arange(rows + 1, dtype=np.int64) * length


def concat_columns(parts: Sequence[Column]) -> Column:
    """The rows of ``parts`` in order as one column (the caller checked that their dtypes
    match and their shapes merge, see :func:`merge_shapes`)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    datas = [part.data for part in parts]
    if len({data.dtype for data in datas}) > 1:
        datas = [data.astype(DTYPES[first.dtype][0], copy=False) for data in datas]
    if all(part.offsets is None for part in parts) and len({part.row_shape for part in parts}) == 1:
        return Column(first.key, first.dtype, np.concatenate(datas))
    ragged = [
        _as_ragged(Column(p.key, p.dtype, d, p.offsets)) for p, d in zip(parts, datas, strict=True)
    ]
    offsets = [np.zeros(1, np.int64)]
    base = 0
    for values, part_offsets in ragged:
        offsets.append(part_offsets[1:] + base)
        base += int(values.shape[0])
    values = np.concatenate([values for values, _ in ragged])
    return Column(first.key, first.dtype, values, np.concatenate(offsets))


# -- samples -> columns ---------------------------------------------------------------------


def where_in_sample(index: int, rows: str, key: str) -> str:
    """``sample 3, key 'x'`` (dict rows), ``sample 3, position 1`` (tuple rows), ``sample
    3`` (tensor rows)."""
    if rows == "dict":
        return f"sample {index}, key {key!r:.80}"
    if rows == "tuple":
        return f"sample {index}, position {key}"
    return f"sample {index}"


def _structure(sample: object, index: int) -> tuple[str, list[str], list[object]]:
    if isinstance(sample, Mapping):
        keys = []
        for key in sample:
            if not isinstance(key, str) or not 0 < len(key) <= 256:
                raise LocalError(
                    f"sample {index} is a dict with the key {key!r:.80}; a dict row needs "
                    "string keys (column names) of 1 to 256 characters"
                )
            keys.append(key)
        keys.sort()
        return "dict", keys, [sample[key] for key in keys]
    if isinstance(sample, tuple | list):
        if not sample:
            raise LocalError(f"sample {index} is an empty {type(sample).__name__}")
        return "tuple", [str(i) for i in range(len(sample))], list(sample)
    return "tensor", ["0"], [sample]


def _part(part: object, where: str, key: str | None) -> tuple[str, np.ndarray]:
    """One part of a sample as (row dtype, little-endian NumPy data)."""
    if isinstance(part, torch.Tensor):
        tensor = part.detach().cpu().resolve_conj().resolve_neg().contiguous()
        name = str(tensor.dtype).removeprefix("torch.")
        if name == "bfloat16":
            return name, tensor.view(torch.int16).numpy()
        if name in DTYPES:
            return name, tensor.numpy()
        raise LocalError(f"{where} is a {name} tensor; a shard stores {', '.join(DTYPES)}")
    if isinstance(part, bool):
        return "bool", np.asarray(part, dtype=np.bool_)
    if isinstance(part, int):
        if not -(1 << 63) <= part < 1 << 63:
            raise LocalError(f"{where} is the integer {part}, which does not fit in int64")
        return "int64", np.asarray(part, dtype=np.int64)
    if isinstance(part, float):
        return "float64", np.asarray(part, dtype=np.float64)
    if isinstance(part, np.ndarray | np.generic) and part.dtype.name in NUMPY_DTYPES:
        array = np.asarray(part)
        return array.dtype.name, array.astype(DTYPES[array.dtype.name][0], copy=False)
    if isinstance(part, str | bytes):
        fix = (
            f"to tokenize it pass --text-field {key} (with --block-size), or drop that "
            "column first (e.g. dataset.remove_columns([...]))"
            if key is not None
            else "tokenize it in the dataset"
        )
        raise LocalError(f"{where} holds text ({type(part).__name__}); {fix}")
    raise LocalError(
        f"{where} holds a {type(part).__name__}; a shard stores tensors, numbers, or tuples "
        "or dicts of them: convert it in the dataset, or drop that column"
    )


def column_from_rows(
    key: str,
    rows: str,
    parts: Sequence[tuple[str, np.ndarray]],
    first: int,
    *,
    locate: Callable[[int], str] | None = None,
) -> Column:
    """One column from its rows' parts (sample ``first`` is the first); a LocalError names
    the first sample whose dtype or shape does not fit the column (``locate(i)`` says where
    sample ``i`` came from, when the source knows better than its index)."""

    def where(index: int) -> str:
        if locate is None:
            return where_in_sample(index, rows, key)
        return f"{locate(index)}, key {key!r:.80}"

    dtype, head = parts[0]
    for i, (name, array) in enumerate(parts):
        if name != dtype:
            raise LocalError(
                f"{where(first + i)} is {name} but sample {first} has {dtype} there; a "
                "column holds one dtype (convert it in the dataset)"
            )
        if array.shape != head.shape and merge_shapes(head.shape, array.shape) is None:
            raise LocalError(
                f"{where(first + i)} has shape {list(array.shape)} but sample {first} has "
                f"{list(head.shape)}; rows of a column may differ in their first dimension "
                "only (pad or crop them in the dataset)"
            )
    arrays = [array for _, array in parts]
    if all(array.shape == head.shape for array in arrays):
        return Column(key, dtype, np.stack(arrays))
    lengths = np.fromiter((array.shape[0] for array in arrays), np.int64, len(arrays))
    offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
    return Column(key, dtype, np.concatenate(arrays), offsets)


def columns_from_samples(
    samples: Sequence[object], first: int = 0
) -> tuple[str, tuple[Column, ...]]:
    """``samples`` (sample ``first`` is the first) as their rows kind and columns; a
    LocalError names the first sample and key that break the structure of the first."""
    if not samples:
        raise LocalError("no samples to store: a shard needs at least one")
    rows, keys, _ = _structure(samples[0], first)
    parts: list[list[tuple[str, np.ndarray]]] = [[] for _ in keys]
    for offset, sample in enumerate(samples):
        index = first + offset
        kind, sample_keys, values = _structure(sample, index)
        if kind != rows or sample_keys != keys:
            shown = f"keys {sample_keys}" if kind == "dict" else f"{len(values)} parts"
            known = f"keys {keys}" if rows == "dict" else f"{len(keys)} parts"
            raise LocalError(
                f"sample {index} is a {kind} row with {shown} but sample {first} is a {rows} "
                f"row with {known}; every sample needs the same structure"
            )
        for column, (key, value) in enumerate(zip(keys, values, strict=True)):
            where = where_in_sample(index, rows, key)
            parts[column].append(_part(value, where, key if rows == "dict" else None))
    return rows, tuple(
        column_from_rows(key, rows, column_parts, first)
        for key, column_parts in zip(keys, parts, strict=True)
    )
