"""A dataset made into content-addressed shard files and the manifest that names them.

``prepare_dataset(source, out)`` reads a source (:mod:`p2ptrain.data.sources`), cuts its rows
into shards (:mod:`p2ptrain.data.shard_cut`), writes each as a shard file
(:mod:`p2ptrain.data.shard_format`) and describes them in ``out/dataset.json``::

    out/dataset.json                        format, manifest, files, descriptor
    out/shards/<name>-00000.safetensors     one file per shard, in manifest order
    out/shards/<name>-val-00000.safetensors the validation split's shards (--val-fraction)

The manifest is a ``sharded`` :class:`~p2ptrain.core.manifests.DatasetManifest`: shard ``i``
is named ``f"{name}-{i:05d}"``, its ``blob_id`` is the SHA-256 of its file and ``bytes`` the
file's size, so a trainer that fetches a shard by hash gets exactly this file. With
``val_fraction`` a validation split is held out (:mod:`p2ptrain.data.holdout`) into the
manifest's ``validation`` shards, ``f"{name}-val-{i:05d}"``, which no lease names; a text
dataset's manifest records its tokenizer (``tokenizer``: kind, vocabulary size, the
characters of a ``chars`` vocabulary, tokens per row).

Crash safety (:mod:`p2ptrain.data.staging`): everything is written and fsynced in a
temporary sibling directory, ``dataset.json`` last, which is then renamed to ``out``: ``out``
is the complete dataset or absent, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import msgspec

from p2ptrain.core.field_rules import MAX_NAME_CHARS, check_name, name_from
from p2ptrain.core.manifests import (
    MAX_SHARD_BYTES,
    MAX_SHARDS,
    DatasetManifest,
    ShardInfo,
    TokenizerSpec,
)
from p2ptrain.data.staging import (
    check_target,
    fsync_directory,
    install,
    staging_directory,
    write_synced,
)
from p2ptrain.errors import InvalidRecord, LocalError

if TYPE_CHECKING:  # preparing imports these (numpy, torch); reading a dataset needs neither
    from p2ptrain.data.shard_cut import Batch, Signature
    from p2ptrain.data.sources import OpenedSource
    from p2ptrain.data.tokenizers import TextStats

__all__ = [
    "DATASET_FORMAT",
    "DEFAULT_SHARD_BYTES",
    "PrepareProgress",
    "PreparedDataset",
    "prepare_dataset",
    "read_prepared",
]

DATASET_FORMAT = "p2ptrain-dataset/1"
#: The size of a shard file that ``prepare_dataset`` aims at by default.
DEFAULT_SHARD_BYTES = 16 << 20
MAX_DATASET_JSON_BYTES = 64 << 20
_SUFFIX_CHARS = 6  # "-00000"
_VAL_SUFFIX = "-val"


@dataclass(frozen=True)
class PrepareProgress:
    """Shards written so far, with their samples and file bytes."""

    shards: int
    samples: int
    bytes: int


@dataclass(frozen=True)
class PreparedDataset:
    """A prepared dataset directory: its manifest, its shard files (absolute paths) and
    what was prepared (``descriptor``, see docs/data.md)."""

    path: Path
    manifest: DatasetManifest
    files: dict[str, Path]
    descriptor: dict[str, object]

    def shard_path(self, name: str) -> Path:
        try:
            return self.files[name]
        except KeyError:
            raise LocalError(
                f"the prepared dataset at {self.path} has no shard {name!r:.100}"
            ) from None

    def describe(self) -> dict[str, object]:
        return {
            "kind": self.manifest.kind,
            "name": self.manifest.name,
            "shards": len(self.manifest.shards),
            "samples": self.manifest.total_samples,
            "bytes": self.manifest.total_bytes,
            "validation_shards": len(self.manifest.validation),
            "validation_samples": self.manifest.validation_samples,
            "location": str(self.path),
        }


class _DatasetFile(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    manifest: DatasetManifest
    files: dict[str, str]
    descriptor: dict[str, Any]


# -- reading --------------------------------------------------------------------------------


def read_prepared(path: str | os.PathLike[str], *, verify: bool = False) -> PreparedDataset:
    """The prepared dataset at ``path`` (its directory or its dataset.json), after checking
    that every shard file is there with its size; ``verify`` also hashes every file. A
    LocalError names the path and the problem."""
    root = Path(path)
    if root.name == "dataset.json" and root.is_file():
        root = root.parent
    index = root / "dataset.json"
    damaged = (
        "the prepared dataset is damaged: prepare it again "
        f"(p2ptrain data prepare SOURCE --out {root} --overwrite)"
    )
    try:
        with open(index, "rb") as handle:
            data = handle.read(MAX_DATASET_JSON_BYTES + 1)
    except FileNotFoundError:
        raise LocalError(
            f"{root} is not a prepared dataset (it has no dataset.json); make one with "
            f"`p2ptrain data prepare SOURCE --out {root}`"
        ) from None
    except OSError as exc:
        raise LocalError(f"cannot read {index}: {exc.strerror}") from exc
    if len(data) > MAX_DATASET_JSON_BYTES:
        raise LocalError(f"{index} is larger than {MAX_DATASET_JSON_BYTES} bytes; {damaged}")
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise LocalError(f"{index} is not valid JSON ({exc}); {damaged}") from None
    found = raw.get("format") if isinstance(raw, dict) else None
    if found != DATASET_FORMAT:
        raise LocalError(
            f"{index} is not a {DATASET_FORMAT} description (its format is {found!r:.60}); "
            "prepare the data with this p2ptrain version"
        )
    try:
        document = msgspec.convert(raw, _DatasetFile)
    except msgspec.ValidationError as exc:
        raise LocalError(f"{index}: {exc}; {damaged}") from None
    manifest = document.manifest
    if manifest.kind != "sharded":
        raise LocalError(
            f"{index}: the manifest's kind is {manifest.kind!r}, not 'sharded'; {damaged}"
        )
    files = {}
    for shard in manifest.all_shards:
        relative = document.files.get(shard.name)
        parts = PurePosixPath(relative).parts if relative else ()
        if not parts or PurePosixPath(relative or "").is_absolute() or ".." in parts:
            raise LocalError(f"{index}: shard {shard.name} has no file inside {root}; {damaged}")
        files[shard.name] = root.absolute().joinpath(*parts)
    extra = sorted(set(document.files) - set(files))
    if extra:
        raise LocalError(f"{index}: the file of {extra[0]!r:.100} belongs to no shard; {damaged}")
    for shard in manifest.all_shards:
        _check_file(root, shard, files[shard.name], verify=verify, damaged=damaged)
    return PreparedDataset(root.absolute(), manifest, files, document.descriptor)


def _check_file(root: Path, shard: ShardInfo, path: Path, *, verify: bool, damaged: str) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise LocalError(
            f"{root}: the file of shard {shard.name} ({path}) is missing; {damaged}"
        ) from None
    except OSError as exc:
        raise LocalError(f"cannot read {path}: {exc.strerror}") from exc
    if size != shard.bytes:
        raise LocalError(
            f"{root}: shard {shard.name} ({path}) has {size} bytes but the manifest says "
            f"{shard.bytes}; {damaged}"
        )
    if verify:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() != shard.blob_id:
            raise LocalError(
                f"{root}: shard {shard.name} ({path}) does not match its hash (its SHA-256 is "
                f"{digest.hexdigest()[:16]}..., the manifest has {shard.blob_id[:16]}...): the "
                f"file was changed or damaged; {damaged}"
            )


# -- writing --------------------------------------------------------------------------------


class _ShardWriter:
    """Writes shard files into ``root/shards`` and keeps their manifest entries."""

    def __init__(
        self,
        root: Path,
        name: str,
        on_progress: Callable[[PrepareProgress], None] | None,
        before: PrepareProgress = PrepareProgress(0, 0, 0),
    ) -> None:
        self.root = root
        self.name = name
        self.on_progress = on_progress
        #: What writers before this one wrote (its progress reports add to it).
        self.before = before
        self.shards: list[ShardInfo] = []
        self.files: dict[str, str] = {}
        self.samples = 0
        self.bytes = 0

    def write(self, batch: Batch) -> None:
        from p2ptrain.data.shard_format import encode_columns

        index = len(self.shards)
        if index >= MAX_SHARDS:
            raise LocalError(
                f"the dataset needs more than {MAX_SHARDS} shards: raise --shard-mb (or "
                "--samples-per-shard)"
            )
        encoded = encode_columns(batch.rows, batch.columns)
        if encoded.size > MAX_SHARD_BYTES:
            raise LocalError(
                f"shard {index} (samples {batch.first}..) would be {encoded.size} bytes; a shard "
                f"holds at most {MAX_SHARD_BYTES}: lower --samples-per-shard (or --shard-mb)"
            )
        name = f"{self.name}-{index:05d}"
        relative = f"shards/{name}.safetensors"
        digest = hashlib.sha256()
        try:
            with open(self.root / relative, "xb") as handle:
                for piece in encoded.pieces():
                    digest.update(piece)
                    handle.write(piece)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise LocalError(f"cannot write {self.root / relative}: {exc.strerror}") from exc
        self.shards.append(
            ShardInfo(name=name, blob_id=digest.hexdigest(), samples=len(batch), bytes=encoded.size)
        )
        self.files[name] = relative
        self.samples += len(batch)
        self.bytes += encoded.size
        if self.on_progress is not None:
            before = self.before
            self.on_progress(
                PrepareProgress(
                    before.shards + len(self.shards),
                    before.samples + self.samples,
                    before.bytes + self.bytes,
                )
            )

    def progress(self) -> PrepareProgress:
        return PrepareProgress(len(self.shards), self.samples, self.bytes)


def prepare_dataset(
    source: object,
    out: str | os.PathLike[str],
    *,
    name: str | None = None,
    samples_per_shard: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    block_size: int | None = None,
    tokenizer: str | None = None,
    text_field: str | None = None,
    split: str | None = None,
    column: str | None = None,
    overwrite: bool = False,
    on_progress: Callable[[PrepareProgress], None] | None = None,
    val_fraction: float | None = None,
) -> PreparedDataset:
    """Prepare ``source`` (a path or a Python dataset, see docs/data.md) into ``out``.

    Shards hold ``samples_per_shard`` rows when given, else as many rows as fit in
    ``shard_bytes`` (at their size as stored: about the file's size). ``block_size``,
    ``tokenizer`` (``bytes``, ``chars`` or a Hugging Face tokenizer directory) and
    ``text_field`` are for text, ``split`` for a Hugging Face DatasetDict, ``column`` names
    the column of ``.npy`` rows (``input_ids``). ``val_fraction`` holds that fraction of the
    rows out as the validation split (:mod:`p2ptrain.data.holdout`). ``out`` must not exist
    unless ``overwrite``; it appears complete or not at all."""
    from p2ptrain.data.holdout import HoldOut
    from p2ptrain.data.shard_cut import cut_shards, merge_signature
    from p2ptrain.data.sources import SourceOptions, open_source

    target = Path(os.path.abspath(out))
    if samples_per_shard is not None and samples_per_shard < 1:
        raise LocalError(f"--samples-per-shard {samples_per_shard}: use 1 or more")
    if not 1 <= shard_bytes <= MAX_SHARD_BYTES:
        raise LocalError(
            f"--shard-mb {shard_bytes / (1 << 20):g}: use more than 0 and at most "
            f"{MAX_SHARD_BYTES >> 20} (a shard file is fetched whole)"
        )
    if block_size is not None and block_size < 1:
        raise LocalError(f"--block-size {block_size}: use 1 or more tokens")
    holdout = None if val_fraction is None else HoldOut(val_fraction)
    check_target(target, overwrite)
    options = SourceOptions(block_size, tokenizer, text_field, split, column)
    opened = open_source(source, options)
    suffix = "" if holdout is None else _VAL_SUFFIX
    dataset_name = _dataset_name(name, opened.default_name or target.name, len(suffix))
    temporary = staging_directory(target)
    try:
        (temporary / "shards").mkdir()
        writer = _ShardWriter(temporary, dataset_name, on_progress)
        val_writer = None
        signature: Signature | None = None
        batches = opened.batches if holdout is None else holdout.training(opened.batches)
        for shard, seen in cut_shards(
            batches, samples_per_shard=samples_per_shard, shard_bytes=shard_bytes
        ):
            writer.write(shard)
            signature = seen
        if signature is None:
            raise LocalError(_empty(opened))
        if holdout is not None:
            holdout.check(writer.samples)
            val_writer = _ShardWriter(
                temporary, dataset_name + suffix, on_progress, writer.progress()
            )
            for held in holdout.held:
                signature = merge_signature(signature, held)
            for shard, _ in cut_shards(
                holdout.held, samples_per_shard=samples_per_shard, shard_bytes=shard_bytes
            ):
                val_writer.write(shard)
        manifest = DatasetManifest(
            name=dataset_name,
            shards=tuple(writer.shards),
            kind="sharded",
            validation=() if val_writer is None else tuple(val_writer.shards),
            tokenizer=_tokenizer_spec(opened.text),
        )
        descriptor = _descriptor(
            opened,
            signature,
            writer,
            samples_per_shard=samples_per_shard,
            shard_bytes=shard_bytes,
            val_writer=val_writer,
            val_fraction=val_fraction,
        )
        files = {**writer.files, **({} if val_writer is None else val_writer.files)}
        document = {
            "format": DATASET_FORMAT,
            "manifest": msgspec.to_builtins(manifest),
            "files": files,
            "descriptor": descriptor,
        }
        write_synced(temporary / "dataset.json", json.dumps(document, indent=1).encode() + b"\n")
        fsync_directory(temporary / "shards")
        fsync_directory(temporary)
        install(temporary, target, overwrite)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    paths = {shard: target / relative for shard, relative in files.items()}
    return PreparedDataset(target, manifest, paths, descriptor)


def _empty(opened: OpenedSource) -> str:
    if opened.text is not None:
        return (
            f"the text has {opened.text.tokens} tokens, fewer than one block of "
            f"{opened.text.block_size}: lower --block-size or add text"
        )
    return "the source has no rows; there is nothing to prepare"


def _tokenizer_spec(text: TextStats | None) -> TokenizerSpec | None:
    """What the manifest records of a text dataset's tokenizer (None: not text)."""
    if text is None:
        return None
    said = text.tokenizer
    kind, size = str(said["kind"]), said["vocab_size"]
    assert isinstance(size, int)
    return TokenizerSpec(
        kind=kind,
        vocab_size=size,
        block_size=text.block_size,
        vocab=str(said.get("vocab", "")) if kind == "chars" else "",
        name=str(said.get("class", "")),
    )


def _descriptor(
    opened: OpenedSource,
    signature: Signature,
    writer: _ShardWriter,
    *,
    samples_per_shard: int | None,
    shard_bytes: int,
    val_writer: _ShardWriter | None,
    val_fraction: float | None,
) -> dict[str, object]:
    text = opened.text
    return {
        "source": opened.description,
        "rows": signature.rows,
        "columns": signature.to_json(),
        "samples": writer.samples,
        "samples_per_shard": samples_per_shard,
        "shard_bytes": None if samples_per_shard else shard_bytes,
        "tokenizer": None if text is None else text.tokenizer,
        "block_size": None if text is None else text.block_size,
        "tokens": None if text is None else text.tokens,
        "dropped_tokens": None if text is None else text.dropped_tokens,
        "documents": None if text is None or not text.documents else text.documents,
        "val_fraction": val_fraction,
        "validation_samples": 0 if val_writer is None else val_writer.samples,
        "created_by": f"p2ptrain {_version()}",
    }


def _version() -> str:
    # The installed distribution's: importing the p2ptrain package itself would pull the
    # node layer (its lazy Trainer API) into the data layer's imports.
    import importlib.metadata  # not on import: `p2ptrain --help` reads this module

    try:
        return importlib.metadata.version("p2ptrain")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _dataset_name(name: str | None, default: str, extra_chars: int) -> str:
    limit = MAX_NAME_CHARS - _SUFFIX_CHARS - extra_chars
    if name is None:
        return name_from(default, limit=limit, fallback="dataset")
    try:
        check_name("dataset.name", name)
    except InvalidRecord as error:
        raise LocalError(f"--name {name!r:.80}: {error.problem}") from error
    if len(name) > limit:
        raise LocalError(f"--name {name!r:.80} is too long; use at most {limit} characters")
    return name
