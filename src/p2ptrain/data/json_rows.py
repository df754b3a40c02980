"""JSON Lines files as rows, and JSON-like values (also Parquet's nested lists) as arrays.

Each line of a ``.jsonl`` file is a JSON object, a dict row whose keys are its columns. A
value becomes a tensor: a bool a 0-d bool, an integer a 0-d int64, a float a 0-d float64, a
(nested, rectangular) list of them a tensor of its shape (a list with any float is float64;
an empty list takes its column's dtype). Where one column mixes integers and floats, the
integers become floats. Text, nulls and nested objects are refused with the file, the line,
its byte offset and the key; with ``--text-field`` the lines' texts are the documents
instead (:mod:`p2ptrain.data.tokenizers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import msgspec
import numpy as np

from p2ptrain.data.columns import Column, column_from_rows
from p2ptrain.errors import LocalError

__all__ = ["JSONLines", "json_column", "value_array"]

_ROWS_PER_BATCH = 4096
_decoder = msgspec.json.Decoder()


class _Refused(Exception):
    """A value p2ptrain cannot store; ``args[0]`` says why."""


def value_array(value: object) -> np.ndarray:
    """``value`` as an array (see the module docstring); raises _Refused."""
    if isinstance(value, bool):
        return np.asarray(value, dtype=np.bool_)
    if isinstance(value, int):
        if not -(1 << 63) <= value < 1 << 63:
            raise _Refused(f"the integer {value} does not fit in int64")
        return np.asarray(value, dtype=np.int64)
    if isinstance(value, float):
        return np.asarray(value, dtype=np.float64)
    if isinstance(value, list):
        try:
            array = np.asarray(value)
        except (ValueError, OverflowError):
            raise _Refused("a nested list whose inner lists differ in length") from None
        if array.size == 0:
            return array.astype(np.int64)
        if array.dtype.kind == "b" or array.dtype == np.float64:
            return array
        if array.dtype.kind in "iu" and array.dtype.itemsize <= 8 and array.dtype != np.uint64:
            return array.astype(np.int64)
        raise _Refused("a list of text, nulls, objects or too large integers")
    if isinstance(value, str):
        raise _Refused("text")
    if value is None:
        raise _Refused("null; fill it in or drop the column")
    raise _Refused(f"a {type(value).__name__}; flatten it into columns of numbers or drop it")


def json_column(
    key: str, values: Sequence[object], first: int, locate: Callable[[int], str]
) -> Column:
    """The column ``key`` of rows ``first..``; ``locate(i)`` says where row ``i`` is."""
    arrays = []
    for i, value in enumerate(values):
        try:
            arrays.append(value_array(value))
        except _Refused as refused:
            problem = refused.args[0]
            if problem == "text":
                problem = (
                    f"text; to tokenize it pass --text-field {key} (with --block-size), or "
                    "drop the key from the rows"
                )
            raise LocalError(f"{locate(first + i)}, key {key!r:.80}: {problem}") from None
    kinds = {a.dtype.name for a in arrays if a.size}
    dtype = "float64" if kinds == {"int64", "float64"} else min(kinds, default="int64")
    if len(kinds) > 1 and kinds != {"int64", "float64"}:
        odd = next(i for i, a in enumerate(arrays) if a.size and a.dtype.name != dtype)
        raise LocalError(
            f"{locate(first + odd)}, key {key!r:.80}: {arrays[odd].dtype.name} where other rows "
            f"hold {dtype}; write the column with one type"
        )
    parts = [(dtype, a.astype(dtype, copy=False)) for a in arrays]
    return column_from_rows(key, "dict", parts, first, locate=locate)


class JSONLines:
    """The rows (or, with ``text_field``, the texts) of ``.jsonl`` files in order."""

    def __init__(self, files: Sequence[Path], text_field: str | None) -> None:
        self.files = files
        self.text_field = text_field

    def _objects(self) -> Iterator[tuple[str, dict[str, object]]]:
        """(location, object) per line; blank lines are skipped."""
        for path in self.files:
            try:
                with open(path, "rb") as handle:
                    yield from _file_objects(path, handle)
            except OSError as exc:
                raise LocalError(f"cannot read {path}: {exc.strerror}") from exc

    def texts(self) -> Iterator[str]:
        field = self.text_field
        for where, value in self._objects():
            text = value.get(field) if field is not None else None
            if not isinstance(text, str):
                raise LocalError(
                    f"{where} has no text under --text-field {field!r:.80} (keys: "
                    f"{sorted(value)!r:.200})"
                )
            yield text

    def batches(self) -> Iterator[tuple[list[str], list[dict[str, object]]]]:
        """Lines as (locations, objects) of up to a few thousand rows, one key set."""
        keys: list[str] | None = None
        where: list[str] = []
        rows: list[dict[str, object]] = []
        for location, value in self._objects():
            mine = sorted(value)
            if keys is None:
                keys = mine
            elif mine != keys:
                raise LocalError(
                    f"{location} has the keys {mine!r:.200} but the first line has "
                    f"{keys!r:.200}; every line needs the same keys"
                )
            where.append(location)
            rows.append(value)
            if len(rows) == _ROWS_PER_BATCH:
                yield where, rows
                where, rows = [], []
        if rows:
            yield where, rows


def _file_objects(path: Path, lines: Iterable[bytes]) -> Iterator[tuple[str, dict[str, object]]]:
    offset = 0
    for number, line in enumerate(lines, 1):
        where = f"{path}, line {number} (byte offset {offset})"
        offset += len(line)
        if not line.strip():
            continue
        try:
            value = _decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise LocalError(f"{where} is not valid JSON ({exc}); fix or remove the line") from None
        if not isinstance(value, dict):
            raise LocalError(
                f"{where} is a JSON {type(value).__name__}, not an object; write one object "
                "per line"
            )
        yield where, value
