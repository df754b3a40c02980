"""Batches of rows in, shards of rows out (pure: no files).

A source gives its rows as :class:`Batch` es of columns (numbers of rows that suit it: a
slice of an array, a thousand JSON lines); :func:`cut_shards` regroups them into shards of
``samples_per_shard`` rows, or else of as many rows as fit in ``shard_bytes`` (a row's size
as stored: every element at the size its column is stored at, integers narrowed as the
batch's values allow, plus 8 bytes of offset per ragged column; a shard holds at least one
row). It also checks that every batch has the structure of the first:
the same rows kind, column keys and dtypes, and row shapes that differ in the first
dimension at most (the column is then ragged, see :mod:`p2ptrain.data.columns`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from p2ptrain.data.columns import Column, Shape, concat_columns, merge_shapes, where_in_sample
from p2ptrain.errors import LocalError

__all__ = ["Batch", "Signature", "concat_batches", "cut_shards", "merge_signature"]


@dataclass(frozen=True, eq=False)
class Batch:
    """Rows ``first .. first + len - 1`` of a dataset, as columns of equal length."""

    rows: str
    columns: tuple[Column, ...]
    first: int

    def __len__(self) -> int:
        return len(self.columns[0])

    def take(self, start: int, stop: int) -> Batch:
        return Batch(
            self.rows, tuple(c.take(start, stop) for c in self.columns), self.first + start
        )

    def row_nbytes(self) -> np.ndarray:
        total = self.columns[0].row_nbytes()
        for column in self.columns[1:]:
            total = total + column.row_nbytes()
        return total


@dataclass(frozen=True)
class Signature:
    """The structure rows have so far: rows kind and (key, dtype, row shape) per column."""

    rows: str
    columns: tuple[tuple[str, str, Shape], ...]

    def to_json(self) -> list[dict[str, object]]:
        return [
            {"key": key, "dtype": dtype, "shape": list(shape)} for key, dtype, shape in self.columns
        ]


def merge_signature(known: Signature | None, batch: Batch) -> Signature:
    """``known`` widened by ``batch`` (a column whose row shapes differ becomes ragged); a
    LocalError names the batch's first sample when its structure does not fit."""
    mine = Signature(batch.rows, tuple((c.key, c.dtype, c.row_shape) for c in batch.columns))
    if known is None:
        return mine
    keys = [key for key, _, _ in known.columns]
    if mine.rows != known.rows or [key for key, _, _ in mine.columns] != keys:
        raise LocalError(
            f"sample {batch.first} is a {mine.rows} row with the columns "
            f"{[key for key, _, _ in mine.columns]!r:.200} but the samples before it are "
            f"{known.rows} rows with {keys!r:.200}; every sample needs the same structure"
        )
    merged = []
    for (key, dtype, shape), (_, new_dtype, new_shape) in zip(
        known.columns, mine.columns, strict=True
    ):
        where = where_in_sample(batch.first, batch.rows, key)
        if new_dtype != dtype:
            raise LocalError(
                f"{where} is {new_dtype} but the samples before it are {dtype}; a column "
                "holds one dtype (convert it in the dataset)"
            )
        wider = merge_shapes(shape, new_shape)
        if wider is None:
            raise LocalError(
                f"{where} has rows of shape {_shown(new_shape)} but the samples before it "
                f"have {_shown(shape)}; rows of a column may differ in their first dimension "
                "only (pad or crop them in the dataset)"
            )
        merged.append((key, dtype, wider))
    return Signature(known.rows, tuple(merged))


def _shown(shape: Shape) -> str:
    return "[" + ", ".join("*" if size is None else str(size) for size in shape) + "]"


def concat_batches(parts: list[Batch]) -> Batch:
    """The rows of consecutive batches as one (no copy for a single batch)."""
    if len(parts) == 1:
        return parts[0]
    columns = tuple(
        concat_columns([part.columns[i] for part in parts]) for i in range(len(parts[0].columns))
    )
    return Batch(parts[0].rows, columns, parts[0].first)


def cut_shards(
    batches: Iterable[Batch], *, samples_per_shard: int | None, shard_bytes: int
) -> Iterator[tuple[Batch, Signature]]:
    """Each shard's rows with the structure of every row so far (see the module
    docstring)."""
    signature: Signature | None = None
    pending: list[Batch] = []
    count = size = 0
    for batch in batches:
        n = len(batch)
        if not n:
            continue
        signature = merge_signature(signature, batch)
        cumulative = None if samples_per_shard else np.cumsum(batch.row_nbytes())
        start = 0
        while start < n:
            if samples_per_shard:
                stop = min(n, start + samples_per_shard - count)
                full = count + stop - start == samples_per_shard
                added = 0
            else:
                assert cumulative is not None
                base = int(cumulative[start - 1]) if start else 0
                stop = int(np.searchsorted(cumulative, shard_bytes - size + base, side="right"))
                full = stop < n
                if stop == start and not count:
                    stop = start + 1  # one row larger than a shard is a shard of its own
                added = int(cumulative[stop - 1]) - base if stop > start else 0
            if stop > start:
                pending.append(batch.take(start, stop))
                count += stop - start
                size += added
            start = stop
            if full:
                yield concat_batches(pending), signature
                pending, count, size = [], 0, 0
    if pending:
        assert signature is not None
        yield concat_batches(pending), signature
