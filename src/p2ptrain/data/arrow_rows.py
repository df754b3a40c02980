"""Arrow tables as rows: Parquet files and Hugging Face ``datasets`` (pyarrow underneath).

A table's columns become the columns of dict rows, sliced whole, never row by row: a
number or bool column is stacked, a list of numbers is ragged (Arrow's own offsets), a
fixed-size list is stacked, and nested lists are taken row by row (they must be
rectangular). Nulls, text (unless it is the ``--text-field``) and other types are refused
naming the file, the row (counting from 0) and the column. A ``datasets.Dataset`` whose
features are all such columns is read the same way; one with other features (images,
audio, ``Array2D``) is read row by row with ``with_format("torch")``; either way its
integers become int64 and its floats float32, as that format gives them (Parquet files keep
their own dtypes).

pyarrow and ``datasets`` are optional: they are imported when a source needs them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain.data.columns import INTEGER_DTYPES, NUMPY_DTYPES, Column, column_from_rows
from p2ptrain.data.shard_cut import Batch
from p2ptrain.errors import LocalError

__all__ = ["ParquetRows", "arrow_batch", "arrow_readable", "import_datasets", "import_pyarrow"]


def import_pyarrow() -> Any:
    try:
        pyarrow = importlib.import_module("pyarrow")
        importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise LocalError(
            "reading Parquet and Hugging Face datasets needs pyarrow: pip install pyarrow "
            "(or pip install 'p2ptrain[hf]')"
        ) from None
    return pyarrow


def import_datasets() -> Any:
    try:
        return importlib.import_module("datasets")
    except ImportError:
        raise LocalError(
            "reading a Hugging Face dataset needs the datasets package: pip install 'p2ptrain[hf]'"
        ) from None


def _number(arrow_type: Any) -> bool:
    pa = import_pyarrow()
    return bool(
        pa.types.is_boolean(arrow_type)
        or pa.types.is_integer(arrow_type)
        or pa.types.is_floating(arrow_type)
    )


def _list(arrow_type: Any) -> bool:
    pa = import_pyarrow()
    return bool(
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    )


def arrow_readable(arrow_type: Any) -> bool:
    """True when a column of this type can be taken as it is (numbers, lists of them)."""
    while _list(arrow_type):
        arrow_type = arrow_type.value_type
    return _number(arrow_type)


def _leaf_dtype(arrow_type: Any) -> str:
    while _list(arrow_type):
        arrow_type = arrow_type.value_type
    name = str(np.dtype(arrow_type.to_pandas_dtype()).name)
    if name not in NUMPY_DTYPES:
        raise LocalError(f"Arrow type {arrow_type} has no tensor dtype")
    return name


def _refuse(key: str, arrow_type: Any, where: str) -> LocalError:
    pa = import_pyarrow()
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        what = "text; pass --text-field with its name to tokenize it, or drop the column"
    else:
        what = f"of Arrow type {arrow_type}, which has no tensor form; drop or convert it"
    return LocalError(f"{where}, column {key!r:.80}: {what}")


def _first_null(array: Any) -> int:
    return int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])


def arrow_column(key: str, array: Any, first: int, locate: Callable[[int], str]) -> Column:
    """One Arrow array (rows ``first..``) as a column; ``locate(i)`` says where row ``i``
    is."""
    pa = import_pyarrow()
    kind = array.type
    if not arrow_readable(kind):
        raise _refuse(key, kind, locate(first))
    if array.null_count:
        raise LocalError(
            f"{locate(first + _first_null(array))}, column {key!r:.80}: null; fill it in or "
            "drop the column"
        )
    if _number(kind):
        data = array.to_numpy(zero_copy_only=False)
        return Column(key, data.dtype.name, data)
    dtype = _leaf_dtype(kind)
    values = array.flatten()
    if _number(kind.value_type) and not values.null_count:
        data = values.to_numpy(zero_copy_only=False)
        if pa.types.is_fixed_size_list(kind):
            return Column(key, dtype, data.reshape(len(array), kind.list_size))
        offsets = np.asarray(array.offsets, dtype=np.int64)
        lengths = np.diff(offsets)
        if lengths.size and (lengths == lengths[0]).all():
            return Column(key, dtype, data.reshape(len(array), int(lengths[0])))
        return Column(key, dtype, data, offsets - offsets[0])
    parts = []
    for i, row in enumerate(array.to_pylist()):
        try:
            parts.append((dtype, np.asarray(row, dtype=dtype)))
        except (ValueError, TypeError):
            raise LocalError(
                f"{locate(first + i)}, column {key!r:.80}: a nested list that is not "
                "rectangular or holds nulls; fix or drop it"
            ) from None
    return column_from_rows(key, "dict", parts, first, locate=locate)


def _torch_format(column: Column) -> Column:
    """The dtypes ``with_format("torch")`` gives: integers int64, floats float32."""
    if column.dtype in INTEGER_DTYPES:
        data = column.data.astype(np.int64) if column.dtype == "uint64" else column.data
        return Column(column.key, "int64", data, column.offsets)
    if column.dtype.startswith("float"):
        data = column.data.astype(np.float32, copy=False)
        return Column(column.key, "float32", data, column.offsets)
    return column


def arrow_batch(
    table: Any, first: int, locate: Callable[[int], str], *, torch_format: bool = False
) -> Batch:
    """A table's rows ``first..`` as dict rows (columns in sorted key order); with
    ``torch_format`` in the dtypes a ``datasets`` torch format gives."""
    keys = sorted(table.column_names)
    if not keys:
        raise LocalError(f"{locate(first)}: the table has no columns")
    columns = tuple(
        arrow_column(key, table.column(key).combine_chunks(), first, locate) for key in keys
    )
    if torch_format:
        columns = tuple(_torch_format(column) for column in columns)
    return Batch("dict", columns, first)


class ParquetRows:
    """The rows (or the ``text_field`` texts) of ``.parquet`` files in order."""

    def __init__(self, files: Sequence[Path], text_field: str | None, batch_bytes: int) -> None:
        self.files = files
        self.text_field = text_field
        self.batch_bytes = batch_bytes

    def _open(self, path: Path) -> Any:
        pa = import_pyarrow()
        try:
            return pa.parquet.ParquetFile(path)
        except (OSError, pa.ArrowException) as exc:
            raise LocalError(f"cannot read {path} as Parquet: {exc}") from exc

    def total_rows(self) -> int:
        return sum(int(self._open(path).metadata.num_rows) for path in self.files)

    def batches(self) -> Iterator[Batch]:
        first = 0
        for path in self.files:
            parquet = self._open(path)
            meta = parquet.metadata
            size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
            rows = max(1, min(1 << 20, self.batch_bytes * meta.num_rows // max(size, 1)))
            start = first

            def locate(i: int, path: Path = path, start: int = start) -> str:
                return f"{path}, row {i - start}"

            for record_batch in parquet.iter_batches(batch_size=rows):
                table = import_pyarrow().Table.from_batches([record_batch])
                yield arrow_batch(table, first, locate)
                first += table.num_rows

    def texts(self) -> Iterator[str]:
        field = self.text_field
        for path in self.files:
            parquet = self._open(path)
            if field not in parquet.schema_arrow.names:
                raise LocalError(
                    f"{path} has no column {field!r:.80} for --text-field (columns: "
                    f"{parquet.schema_arrow.names!r:.200})"
                )
            row = 0
            for record_batch in parquet.iter_batches(columns=[field]):
                for text in record_batch.column(0).to_pylist():
                    if not isinstance(text, str):
                        raise LocalError(
                            f"{path}, row {row}, column {field!r:.80}: "
                            f"{type(text).__name__}, not text"
                        )
                    yield text
                    row += 1
