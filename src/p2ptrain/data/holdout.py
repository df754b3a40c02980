"""A validation split held out of a dataset as it is prepared (``--val-fraction F``).

The held-out rows are spread evenly through the source: with ``F = p/q`` (the fraction as
the nearest ratio of integers with ``q`` at most a million, so 0.1 is exactly 1/10), row
``i`` (counting from 0 in the source's order) is held out when ``floor((i+1)p/q) >
floor(ip/q)``. That holds out ``floor(N p/q)`` of ``N`` rows, one in every ``q/p``: rows 9,
19, 29, ... for 0.1. Text is cut into rows before the split, so a held-out row is a whole
block of tokens. The rest are the training rows, in their order.

:class:`HoldOut` splits a stream of batches (pure: no files); the held-out rows are kept in
memory (copies of those rows only) until the training rows are written.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from fractions import Fraction

import numpy as np

from p2ptrain.data.columns import Column
from p2ptrain.data.shard_cut import Batch
from p2ptrain.errors import LocalError

__all__ = ["HoldOut", "held_out_mask"]

_MAX_DENOMINATOR = 1_000_000


def _ratio(fraction: float) -> Fraction:
    if not 0.0 < fraction < 1.0:
        raise LocalError(
            f"--val-fraction {fraction:g}: use a fraction between 0 and 1 (0.1 holds out one "
            "row in ten for validation)"
        )
    ratio = Fraction(repr(fraction)).limit_denominator(_MAX_DENOMINATOR)
    if ratio <= 0 or ratio >= 1:
        raise LocalError(
            f"--val-fraction {fraction:g} rounds to {ratio}: use a fraction between "
            f"1/{_MAX_DENOMINATOR} and 1 - 1/{_MAX_DENOMINATOR}"
        )
    return ratio


def held_out_mask(first: int, count: int, ratio: Fraction) -> np.ndarray:
    """Which of the rows ``first .. first + count - 1`` are held out (see the module
    docstring)."""
    rows = np.arange(first, first + count, dtype=np.int64)
    p, q = ratio.numerator, ratio.denominator
    mask: np.ndarray = ((rows + 1) * p) // q > (rows * p) // q
    return mask


def _select(column: Column, keep: np.ndarray) -> Column:
    """The rows of ``column`` where ``keep`` is true (a copy)."""
    if column.offsets is None:
        return Column(column.key, column.dtype, column.data[keep])
    starts, stops = column.offsets[:-1][keep], column.offsets[1:][keep]
    offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(stops - starts, out=offsets[1:])
    pieces = [np.arange(a, b, dtype=np.int64) for a, b in zip(starts, stops, strict=True)]
    index = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return Column(column.key, column.dtype, column.data[index], offsets)


def _rows(batch: Batch, keep: np.ndarray) -> Batch | None:
    """The rows of ``batch`` where ``keep`` is true, or None when there are none."""
    if not keep.any():
        return None
    if keep.all():
        return batch
    first = batch.first + int(np.argmax(keep))
    return Batch(batch.rows, tuple(_select(c, keep) for c in batch.columns), first)


class HoldOut:
    """Splits batches into training rows (passed on) and held-out rows (kept in
    :attr:`held`)."""

    def __init__(self, fraction: float) -> None:
        self.ratio = _ratio(fraction)
        self.held: list[Batch] = []
        self.rows = 0

    def training(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """The training rows of ``batches``; the held-out ones go to :attr:`held`."""
        for batch in batches:
            count = len(batch)
            if not count:
                continue
            mask = held_out_mask(batch.first, count, self.ratio)
            held = _rows(batch, mask)
            if held is not None:
                self.held.append(held)
                self.rows += len(held)
            kept = _rows(batch, ~mask)
            if kept is not None:
                yield kept

    def check(self, training_rows: int) -> None:
        """LocalError unless some row was held out (``F < 1`` always leaves training
        rows: ``floor(N F) < N``)."""
        if not self.rows:
            total = training_rows + self.rows
            raise LocalError(
                f"--val-fraction {float(self.ratio):g} holds out no row of {total}: the "
                f"validation split needs at least one; raise --val-fraction to at least "
                f"{1 / max(1, total):.3g} (or prepare more data)"
            )
