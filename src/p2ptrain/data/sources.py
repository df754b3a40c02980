"""What ``data prepare`` reads: a path or a Python dataset, as batches of rows.

Paths (one file, or a directory of files of one kind; hidden files are ignored):

* ``.txt`` -- text, tokenized and cut into rows ``{"input_ids": int64[block_size]}``
  (:mod:`p2ptrain.data.tokenizers`), files in sorted name order;
* ``.jsonl`` -- one JSON object per line (:mod:`p2ptrain.data.json_rows`);
* ``.parquet`` -- Arrow columns (:mod:`p2ptrain.data.arrow_rows`);
* ``.npy`` -- rows along axis 0, the files concatenated in sorted name order, as dict rows
  with one column (``input_ids`` unless ``column`` names another), memory-mapped;
* ``.npz`` -- each file's arrays are the columns of dict rows (sorted by name) and share
  their first dimension; the files follow each other and have the same arrays;
* a directory written by ``datasets.Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``
  (it holds ``state.json`` or ``dataset_dict.json``; ``split`` picks a DatasetDict's split,
  ``train`` by default).

Python objects: a ``datasets.Dataset`` / ``DatasetDict`` (as above), a
``datasets.IterableDataset`` (rows ``with_format("torch")``), any map-style dataset
(``len`` and ``dataset[i]``) or iterable of rows. With ``text_field``, the rows' texts under
that key are tokenized and cut into blocks as for ``.txt`` files.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain.data.arrow_rows import (
    ParquetRows,
    arrow_batch,
    arrow_readable,
    import_datasets,
)
from p2ptrain.data.columns import NUMPY_DTYPES, Column, columns_from_samples
from p2ptrain.data.json_rows import JSONLines, json_column
from p2ptrain.data.shard_cut import Batch
from p2ptrain.data.tokenizers import (
    TextStats,
    line_pieces,
    make_tokenizer,
    text_pieces,
    token_blocks,
)
from p2ptrain.errors import LocalError

__all__ = ["FILE_KINDS", "OpenedSource", "SourceOptions", "open_source"]

FILE_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet", ".npy": "npy", ".npz": "npz"}


@dataclass(frozen=True)
class SourceOptions:
    block_size: int | None = None
    tokenizer: str | None = None
    text_field: str | None = None
    split: str | None = None
    column: str | None = None
    #: About how many bytes of rows a batch holds (several shards' worth: a shard that is
    #: a slice of one batch is not copied).
    batch_bytes: int = 64 << 20


@dataclass
class OpenedSource:
    """A source ready to read: ``batches`` yields its rows once."""

    description: dict[str, object]
    batches: Iterator[Batch]
    default_name: str | None
    text: TextStats | None = None


def open_source(source: object, options: SourceOptions) -> OpenedSource:
    """``source`` (a path or a Python dataset, see the module docstring) ready to read."""
    if isinstance(source, str | os.PathLike):
        return _open_path(Path(source), options)
    if type(source).__module__.split(".")[0] == "datasets":
        return _open_hf(source, options, {"kind": f"datasets.{type(source).__name__}"})
    _refuse_options(options, split=True, column=True)
    description: dict[str, object] = {"kind": "python", "type": _type_name(source)}
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        dataset: Any = source
        description["rows"] = len(dataset)

        def rows() -> Iterator[object]:
            return (dataset[i] for i in range(len(dataset)))

        return _rows_source(description, None, rows, options, replayable=True)
    if hasattr(source, "__iter__"):
        iterable: Any = source
        return _rows_source(
            description,
            None,
            lambda: iter(iterable),
            options,
            replayable=iter(iterable) is not iterable,
        )
    raise LocalError(
        f"cannot prepare a {_type_name(source)}: pass a path, a map-style dataset (len and "
        "dataset[i]) or an iterable of rows"
    )


def _type_name(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _refuse_options(
    options: SourceOptions, *, text: bool = False, split: bool = False, column: bool = False
) -> None:
    """LocalError when an option is given that this source has no use for."""
    if text and (options.block_size is not None or options.tokenizer is not None):
        raise LocalError(
            "--block-size and --tokenizer apply to text: .txt files, or rows with a --text-field"
        )
    if split and options.split is not None:
        raise LocalError("--split picks a split of a Hugging Face DatasetDict; this is none")
    if column and options.column is not None:
        raise LocalError("--column names the column of .npy files; this source has its own")


# -- paths ----------------------------------------------------------------------------------


def _files(path: Path) -> tuple[str, list[Path]]:
    """The kind and the files of a path source."""
    if not path.exists():
        raise LocalError(f"{path} does not exist; pass a data file or directory")
    if path.is_file():
        kind = FILE_KINDS.get(path.suffix.lower())
        if kind is None:
            raise LocalError(f"{path}: p2ptrain prepares {', '.join(FILE_KINDS)} files")
        return kind, [path]
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return "huggingface", []
    entries = sorted(entry for entry in path.iterdir() if not entry.name.startswith("."))
    folders = [entry.name for entry in entries if entry.is_dir()]
    if folders:
        raise LocalError(
            f"{path} holds folders ({', '.join(folders[:5])}); p2ptrain prepares the files of "
            "one directory: pass a folder, or move the files together"
        )
    kinds: dict[str, list[Path]] = {}
    for entry in entries:
        kinds.setdefault(entry.suffix.lower() or entry.name, []).append(entry)
    if not kinds:
        raise LocalError(f"{path} is empty; there is nothing to prepare")
    if len(kinds) > 1 or next(iter(kinds)) not in FILE_KINDS:
        found = ", ".join(f"{suffix} ({len(files)})" for suffix, files in kinds.items())
        raise LocalError(
            f"{path} holds files of several kinds or an unknown kind: {found}; p2ptrain "
            f"prepares one kind at a time ({', '.join(FILE_KINDS)}): move the others out"
        )
    suffix, files = next(iter(kinds.items()))
    return FILE_KINDS[suffix], files


def _open_path(path: Path, options: SourceOptions) -> OpenedSource:
    kind, files = _files(path)
    name = path.stem if path.is_file() else path.resolve().name
    description: dict[str, object] = {"kind": kind, "path": str(path.resolve())}
    if files:
        description["files"] = len(files)
    if kind == "huggingface":
        datasets = import_datasets()
        try:
            loaded = datasets.load_from_disk(str(path))
        except (OSError, ValueError) as exc:
            raise LocalError(f"cannot load the Hugging Face dataset at {path}: {exc}") from exc
        opened = _open_hf(loaded, options, description)
        opened.default_name = name
        return opened
    _refuse_options(options, split=True, column=kind != "npy")
    if kind == "txt":
        if options.text_field is not None:
            raise LocalError("--text-field names a field of .jsonl or .parquet rows, not .txt")
        return _text_source(description, name, lambda: _file_texts(files, options), options, False)
    if kind == "npy":
        _refuse_options(options, text=True)
        return OpenedSource(description, _npy_batches(files, options), name)
    if kind == "npz":
        _refuse_options(options, text=True)
        return OpenedSource(description, _npz_batches(files, options), name)
    reader: JSONLines | ParquetRows
    if kind == "jsonl":
        reader = JSONLines(files, options.text_field)
    else:
        reader = ParquetRows(files, options.text_field, options.batch_bytes)
    if options.text_field is not None:
        description["text_field"] = options.text_field
        return _text_source(description, name, reader.texts, options, True)
    _refuse_options(options, text=True)
    batches = _jsonl_batches(reader) if isinstance(reader, JSONLines) else reader.batches()
    return OpenedSource(description, batches, name)


def _file_texts(files: Sequence[Path], options: SourceOptions) -> Iterator[str]:
    """The text of ``files`` in pieces; for a Hugging Face tokenizer cut at line ends."""
    for path in files:
        pieces = text_pieces(path)
        yield from pieces if options.tokenizer in (None, "bytes", "chars") else line_pieces(pieces)


def _jsonl_batches(reader: JSONLines) -> Iterator[Batch]:
    first = 0
    for where, rows in reader.batches():

        def locate(i: int, where: list[str] = where, first: int = first) -> str:
            return where[i - first]

        columns = tuple(
            json_column(key, [row[key] for row in rows], first, locate) for key in sorted(rows[0])
        )
        yield Batch("dict", columns, first)
        first += len(rows)


def _loaded(path: Path, mmap: bool) -> Any:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise LocalError(
            f"cannot read {path} as NumPy data without pickle ({exc}); save plain numeric "
            "arrays (np.save / np.savez)"
        ) from exc


def _check_array(path: Path, key: str, array: np.ndarray, like: np.ndarray | None) -> None:
    if array.ndim < 1 or array.dtype.name not in NUMPY_DTYPES:
        raise LocalError(
            f"{path}: array {key!r} is {array.dtype} of shape {list(array.shape)}; p2ptrain "
            "takes rows along axis 0 of arrays of numbers or bools"
        )
    if like is not None and (array.dtype != like.dtype or array.shape[1:] != like.shape[1:]):
        raise LocalError(
            f"{path}: array {key!r} has rows of {array.dtype} {list(array.shape[1:])} but the "
            f"files before it have {like.dtype} {list(like.shape[1:])}; make them alike"
        )


def _slices(columns: dict[str, np.ndarray], first: int, batch_bytes: int) -> Iterator[Batch]:
    rows = len(next(iter(columns.values())))
    row_bytes = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in columns.values())
    step = max(1, batch_bytes // max(row_bytes, 1))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        parts = tuple(Column(key, a.dtype.name, a[start:stop]) for key, a in columns.items())
        yield Batch("dict", parts, first + start)


def _npy_batches(files: Sequence[Path], options: SourceOptions) -> Iterator[Batch]:
    key = options.column or "input_ids"
    arrays = [_loaded(path, mmap=True) for path in files]
    for i, (path, array) in enumerate(zip(files, arrays, strict=True)):
        _check_array(path, key, array, arrays[0] if i else None)
    first = 0
    for array in arrays:
        yield from _slices({key: array}, first, options.batch_bytes)
        first += len(array)


def _npz_batches(files: Sequence[Path], options: SourceOptions) -> Iterator[Batch]:
    first = 0
    known: dict[str, np.ndarray] = {}
    for path in files:
        with _loaded(path, mmap=False) as archive:
            arrays = {key: archive[key] for key in sorted(archive.files)}
        if not arrays or (known and sorted(known) != sorted(arrays)):
            raise LocalError(
                f"{path} holds the arrays {sorted(arrays)}"
                + (f" but the files before it {sorted(known)}" if known else "")
                + "; every .npz needs the same, non-empty set"
            )
        for key, array in arrays.items():
            _check_array(path, key, array, known.get(key))
        lengths = {len(array) for array in arrays.values()}
        if len(lengths) > 1:
            shown = {key: len(array) for key, array in arrays.items()}
            raise LocalError(f"{path}: the arrays have different numbers of rows {shown}")
        known = arrays
        yield from _slices(arrays, first, options.batch_bytes)
        first += lengths.pop()


# -- Python rows ----------------------------------------------------------------------------


def _sample_batches(samples: Iterator[object], batch_bytes: int) -> Iterator[Batch]:
    """Rows in batches of about ``batch_bytes`` (the first batch of 64 rows measures)."""
    first, size = 0, 64
    while True:
        chunk = list(itertools.islice(samples, size))
        if not chunk:
            return
        rows, columns = columns_from_samples(chunk, first)
        batch = Batch(rows, columns, first)
        yield batch
        first += len(chunk)
        per_row = max(1, int(batch.row_nbytes().mean()))
        size = max(1, min(1 << 16, batch_bytes // per_row))


def _rows_source(
    description: dict[str, object],
    name: str | None,
    rows: Callable[[], Iterator[object]],
    options: SourceOptions,
    *,
    replayable: bool,
) -> OpenedSource:
    field = options.text_field
    if field is None:
        _refuse_options(options, text=True)
        return OpenedSource(description, _sample_batches(rows(), options.batch_bytes), name)
    description["text_field"] = field

    def texts() -> Iterator[str]:
        for index, row in enumerate(rows()):
            text = row.get(field) if isinstance(row, Mapping) else None
            if not isinstance(text, str):
                raise LocalError(f"sample {index} has no text under --text-field {field!r:.80}")
            yield text

    if not replayable and options.tokenizer == "chars":
        kept = list(texts())  # the chars vocabulary reads the texts twice
        return _text_source(description, name, lambda: iter(kept), options, True)
    return _text_source(description, name, texts, options, True)


def _open_hf(dataset: Any, options: SourceOptions, description: dict[str, object]) -> OpenedSource:
    datasets = import_datasets()
    _refuse_options(options, column=True)
    if isinstance(dataset, datasets.DatasetDict | datasets.IterableDatasetDict):
        split = options.split or "train"
        if split not in dataset:
            raise LocalError(
                f"the dataset has no split {split!r:.80}; pick one of {sorted(dataset)} with "
                "--split"
            )
        description["split"] = split
        dataset = dataset[split]
    elif options.split is not None:
        _refuse_options(options, split=True)
    name = getattr(getattr(dataset, "info", None), "dataset_name", None)
    if isinstance(dataset, datasets.IterableDataset):
        torch_rows = dataset.with_format("torch")
        return _rows_source(description, name, lambda: iter(torch_rows), options, replayable=True)
    if not isinstance(dataset, datasets.Dataset):
        raise LocalError(f"cannot prepare a {_type_name(dataset)}")
    description["rows"] = len(dataset)
    if options.text_field is not None:
        field = options.text_field
        if field not in dataset.column_names:
            raise LocalError(
                f"the dataset has no column {field!r:.80} for --text-field (columns: "
                f"{dataset.column_names!r:.200})"
            )
        column = dataset.select_columns([field])

        def texts() -> Iterator[str]:
            for start, batch in enumerate(column.iter(batch_size=1000)):
                for offset, text in enumerate(batch[field]):
                    if not isinstance(text, str):
                        raise LocalError(
                            f"row {start * 1000 + offset}, column {field!r:.80}: "
                            f"{type(text).__name__}, not text"
                        )
                    yield text

        description["text_field"] = field
        return _text_source(description, name, texts, options, True)
    _refuse_options(options, text=True)
    schema = dataset.features.arrow_schema
    if all(arrow_readable(kind) for kind in schema.types):
        return OpenedSource(description, _hf_arrow_batches(dataset, options.batch_bytes), name)
    torch_rows = dataset.with_format("torch")
    return _rows_source(
        description,
        name,
        lambda: (torch_rows[i] for i in range(len(torch_rows))),
        options,
        replayable=True,
    )


def _hf_arrow_batches(dataset: Any, batch_bytes: int) -> Iterator[Batch]:
    table = dataset.with_format("arrow")
    rows = len(table)
    step = max(1, min(1 << 20, batch_bytes * rows // max(dataset.data.nbytes, 1)))
    for start in range(0, rows, step):
        yield arrow_batch(
            table[start : start + step], start, lambda i: f"row {i}", torch_format=True
        )


# -- text -----------------------------------------------------------------------------------


def _text_source(
    description: dict[str, object],
    name: str | None,
    texts: Callable[[], Iterable[str]],
    options: SourceOptions,
    documents: bool,
) -> OpenedSource:
    """Rows ``{"input_ids": int64[block_size]}`` of the tokenized ``texts``; each text is a
    document followed by the separator when ``documents``, else a piece of a file."""
    if options.block_size is None:
        raise LocalError("text needs --block-size: the number of tokens per row (e.g. 256 or 1024)")
    tokenizer = make_tokenizer(options.tokenizer or "bytes", texts, rows=documents)
    stats = TextStats(tokenizer.descriptor, options.block_size)
    batches = token_blocks(texts(), tokenizer, stats, documents=documents)
    return OpenedSource(description, batches, name, stats)
