"""Shards of a map-style dataset, and the sample indices a lease names.

An experiment manifest lists its dataset as shards (DESIGN §3): shard ``i`` of a dataset of
``n`` samples covers the indices ``[i*S, min((i+1)*S, n))`` for ``S`` samples per shard, its
name is ``f"{name}-{i:05d}"`` (so names sort in index order, as the manifest requires), and
its ``blob_id`` is the SHA-256 of the shard's samples in a canonical byte form. Two peers
whose local copies of the data differ therefore compute different manifests, and notice
before they train on different data under the same name.

A lease (:mod:`p2ptrain.protocol.leases`) names ``(shard, start, count)`` parts: ``count``
consecutive samples of the shard from ``start`` on, wrapping around the shard's end.
:func:`lease_indices` turns those parts into dataset indices.

Canonical sample bytes
----------------------
A sample is a tensor, a number, a tuple/list of them, or a dict of them with string keys
(``dataset[i]``; a ``datasets.Dataset.with_format("torch")`` row is such a dict). A part is
hashed as ``b"<dtype>[<shape>]\n"`` and its raw little-endian bytes (row-major). A tensor,
number or tuple/list is hashed as ``b"sample <number of parts>\n"`` followed by its parts in
order. A dict is hashed as ``b"sample dict <number of keys>\n"`` followed, for each key in
sorted order (by code point), by ``b"key <n>:"``, the key's ``n`` UTF-8 bytes and ``b"\n"``,
then its value as a part; so a dict never hashes like a tuple of the same tensors, and the
order in which a dataset builds its dict does not matter. Python bools hash as bool tensors,
ints as int64 and floats as float64, so ``(image, label)`` samples hash the same on every
machine. A shard's ``blob_id`` hashes ``b"p2ptrain/v1/shard\n"`` and then its samples in
index order.

A dataset whose samples are tuples of same-shaped tensors (or single tensors) may also offer
``stacked_samples(start, stop)``: the parts of samples ``start..stop-1`` stacked along a new
first dimension. The shard's bytes are then built in one piece instead of sample by sample
(the same bytes: the first sample of every shard is checked against ``dataset[start]``), so
a corpus of 10^5 blocks hashes in a fraction of a second instead of seconds, in every seed
and trainer that starts.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from p2ptrain.core.field_rules import MAX_NAME_CHARS, check_name
from p2ptrain.core.manifests import MAX_SHARDS, DatasetManifest, ShardInfo
from p2ptrain.errors import InvalidRecord, LocalError
from p2ptrain.protocol.leases import Lease, lease_runs

__all__ = ["MapDataset", "dataset_manifest", "lease_indices", "sample_bytes", "shard_blob_id"]

#: Room left in a shard name for the ``-00000`` suffix.
_SUFFIX_CHARS = 6


class MapDataset(Protocol):
    """What :func:`dataset_manifest` needs: ``len()`` and ``dataset[i]`` (a tensor, a
    number, a tuple of them, or a dict of them with string keys)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> object: ...


def number_tensor(value: object) -> torch.Tensor | None:
    """``value`` as a tensor when it is a Python bool, int or float (bool, int64, float64),
    else None."""
    if isinstance(value, bool):
        return torch.tensor(value, dtype=torch.bool)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    return None


def _as_tensor(part: object, index: int, key: str | None = None) -> torch.Tensor:
    if isinstance(part, torch.Tensor):
        return part
    number = number_tensor(part)
    if number is not None:
        return number
    where = f"sample {index}" if key is None else f"sample {index}, key {key!r:.80},"
    raise LocalError(
        f"{where} holds a {type(part).__name__}; a sharded dataset must return tensors, "
        "numbers, or tuples or dicts of them from __getitem__ (convert it in the dataset"
        + (", or drop that column, e.g. dataset.remove_columns([...]))" if key else ")")
    )


def _part_bytes(tensor: torch.Tensor) -> list[bytes]:
    tensor = tensor.detach().cpu().contiguous()
    shape = ",".join(str(size) for size in tensor.shape)
    pieces = [f"{str(tensor.dtype).removeprefix('torch.')}[{shape}]\n".encode()]
    if tensor.numel():
        pieces.append(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return pieces


def _dict_bytes(sample: Mapping[object, object], index: int) -> list[bytes]:
    names: list[str] = []
    for key in sample:
        if not isinstance(key, str):
            raise LocalError(
                f"sample {index} is a dict with the key {key!r:.80}, which is not a string; "
                "a sharded dataset's dict rows need string keys (column names)"
            )
        names.append(key)
    pieces = [b"sample dict %d\n" % len(names)]
    for name in sorted(names):
        encoded = name.encode()
        pieces.append(b"key %d:" % len(encoded) + encoded + b"\n")
        pieces.extend(_part_bytes(_as_tensor(sample[name], index, name)))
    return pieces


def sample_bytes(sample: object, index: int = 0) -> list[bytes]:
    """The canonical byte pieces of one sample (see the module docstring)."""
    if sys.byteorder != "little":
        raise LocalError("p2ptrain hashes datasets on little-endian machines only")
    if isinstance(sample, Mapping):
        return _dict_bytes(sample, index)
    parts = list(sample) if isinstance(sample, tuple | list) else [sample]
    pieces = [b"sample %d\n" % len(parts)]
    for part in parts:
        pieces.extend(_part_bytes(_as_tensor(part, index)))
    return pieces


def _stacked_bytes(parts: Sequence[torch.Tensor], start: int, stop: int) -> bytes:
    """The canonical bytes of samples ``start..stop-1`` given as stacked ``parts``."""
    count = stop - start
    rows = [torch.frombuffer(bytearray(b"sample %d\n" % len(parts)), dtype=torch.uint8)]
    columns = [rows[0].expand(count, -1)]
    for k, part in enumerate(parts):
        if not isinstance(part, torch.Tensor) or part.dim() < 1 or part.shape[0] != count:
            raise LocalError(
                f"stacked_samples({start}, {stop}) returned part {k} as "
                f"{getattr(part, 'shape', type(part).__name__)}; each part must be a tensor "
                f"whose first dimension is the {count} samples"
            )
        header = _part_bytes(part[0])[0]
        columns.append(torch.frombuffer(bytearray(header), dtype=torch.uint8).expand(count, -1))
        if part[0].numel():
            flat = part.detach().cpu().contiguous().reshape(count, -1)
            columns.append(flat.view(torch.uint8))
    return bytes(torch.cat(columns, dim=1).numpy().tobytes())


def shard_blob_id(dataset: MapDataset, start: int, stop: int) -> str:
    """SHA-256 hex of the canonical bytes of samples ``start..stop-1``, in index order."""
    digest = hashlib.sha256(b"p2ptrain/v1/shard\n")
    stacked = getattr(dataset, "stacked_samples", None)
    if callable(stacked) and stop > start:
        whole = _stacked_bytes(stacked(start, stop), start, stop)
        first = b"".join(sample_bytes(dataset[start], start))
        if not whole.startswith(first) or len(whole) != len(first) * (stop - start):
            raise LocalError(
                f"{type(dataset).__name__}.stacked_samples({start}, {stop}) does not hold "
                f"the samples dataset[{start}..{stop - 1}] returns; fix it or remove it "
                "(the samples are then hashed one by one)"
            )
        digest.update(whole)
        return digest.hexdigest()
    for index in range(start, stop):
        for piece in sample_bytes(dataset[index], index):
            digest.update(piece)
    return digest.hexdigest()


def dataset_manifest(dataset: MapDataset, *, name: str, samples_per_shard: int) -> DatasetManifest:
    """The manifest of ``dataset`` cut into shards of ``samples_per_shard`` samples (the last
    shard holds the remainder). Hashes every sample once: seconds for ~10^5 small samples."""
    total = len(dataset)
    if samples_per_shard < 1:
        raise LocalError(f"samples_per_shard must be at least 1, got {samples_per_shard}")
    if total < 1:
        raise LocalError(f"dataset {name!r} is empty; a sharded dataset needs samples")
    count = -(-total // samples_per_shard)
    if count > MAX_SHARDS:
        raise LocalError(
            f"{total} samples in shards of {samples_per_shard} make {count} shards; the limit "
            f"is {MAX_SHARDS}: raise samples_per_shard to at least {-(-total // MAX_SHARDS)}"
        )
    try:
        check_name("dataset.name", name)
    except InvalidRecord as error:
        raise LocalError(f"cannot name a dataset {name!r:.80}: {error.problem}") from error
    if len(name) > MAX_NAME_CHARS - _SUFFIX_CHARS:
        raise LocalError(
            f"dataset name {name!r:.80} is too long; use at most "
            f"{MAX_NAME_CHARS - _SUFFIX_CHARS} characters"
        )
    shards = []
    for i in range(count):
        start, stop = i * samples_per_shard, min((i + 1) * samples_per_shard, total)
        shards.append(
            ShardInfo(
                name=f"{name}-{i:05d}",
                blob_id=shard_blob_id(dataset, start, stop),
                samples=stop - start,
            )
        )
    return DatasetManifest(name=name, shards=tuple(shards))


def lease_indices(dataset: DatasetManifest, lease: Lease) -> list[int]:
    """The dataset indices a lease names, in lease order (:func:`lease_runs` says which)."""
    return [index for begin, end in lease_runs(dataset, lease) for index in range(begin, end)]
