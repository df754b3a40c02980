"""Data pipelines: how a trainer gets the samples its lease names (docs/data.md).

A lease (:mod:`p2ptrain.protocol.leases`) names samples by global index: shard ``i`` of the
experiment's dataset holds the indices after the shards before it. Every pipeline shows a
trainer the same thing, a map-style view of the whole dataset by global index
(:meth:`DataPipeline.view`), so the inner loop, its seeded minibatches and the synchronous
baseline do not depend on where the bytes come from. The four kinds differ in where that is:

* ``indexed`` -- a map-style dataset every trainer holds (a ``torch`` ``Dataset``, a Hugging
  Face ``datasets.Dataset``): shards hash its samples
  (:func:`~p2ptrain.data.shards.dataset_manifest`).
* ``sharded`` -- shard files made by ``p2ptrain data prepare`` (:mod:`.prepare`), each one blob
  named by its hash; a trainer holds only the shards its leases need (a node's shard cache
  fetches them first) and :meth:`ShardedData.view` reads them where ``locate`` finds them.
  The held-out validation shards (``--val-fraction``), which no lease names, are read the
  same way by :meth:`ShardedData.validation_view`.
* ``generated`` -- samples made from their index and the experiment's seed: nothing moves.
* ``custom`` -- a callback given the lease returns its samples (:meth:`DataPipeline.begin_lease`).

Each pipeline says what it is (:meth:`DataPipeline.describe`) for ``p2ptrain status`` and docs.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch

from p2ptrain.core.manifests import DatasetManifest, ShardInfo
from p2ptrain.data.shard_format import ShardRows, open_shard
from p2ptrain.data.shards import MapDataset, dataset_manifest, lease_indices
from p2ptrain.errors import LocalError
from p2ptrain.protocol.leases import Lease

__all__ = [
    "CustomData",
    "DataDescription",
    "DataPipeline",
    "GeneratedData",
    "IndexedData",
    "ShardMissing",
    "ShardedData",
    "as_pipeline",
]

#: Shards a :class:`ShardedData` view keeps open (a lease rarely spans more).
_OPEN_SHARDS = 8


class DataDescription(msgspec.Struct, frozen=True, kw_only=True):
    """What a pipeline is, for people: its kind, a line saying what it holds, and where its
    local data lives (None: nowhere on disk)."""

    kind: str
    descriptor: str
    location: str | None = None


@runtime_checkable
class DataPipeline(Protocol):
    """Where a trainer's samples come from (see the module docstring)."""

    kind: str

    def dataset_manifest(self) -> DatasetManifest:
        """The shards the experiment manifest lists (names, hashes, sample counts)."""
        ...

    def describe(self) -> DataDescription: ...

    def view(self) -> MapDataset:
        """Samples by global index (only those of the current lease need to be readable)."""
        ...

    def begin_lease(self, lease: Lease) -> None:
        """Called before training on ``lease`` (in the training thread)."""
        ...


def _plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def _shape(manifest: DatasetManifest) -> str:
    return (
        f"{_plural(manifest.total_samples, 'sample')} in {_plural(len(manifest.shards), 'shard')}"
    )


class IndexedData:
    """A map-style dataset every trainer holds; its shards hash its samples."""

    kind = "indexed"

    def __init__(self, dataset: MapDataset, *, name: str, samples_per_shard: int) -> None:
        self.dataset = dataset
        self.name = name
        self.samples_per_shard = samples_per_shard
        self._manifest: DatasetManifest | None = None

    def dataset_manifest(self) -> DatasetManifest:
        if self._manifest is None:
            self._manifest = dataset_manifest(
                self.dataset, name=self.name, samples_per_shard=self.samples_per_shard
            )
        return self._manifest

    def describe(self) -> DataDescription:
        count = len(self.dataset)
        return DataDescription(
            kind=self.kind,
            descriptor=f"{type(self.dataset).__name__} {self.name!r}: "
            f"{_plural(count, 'sample')} in shards of {self.samples_per_shard}",
            location="held by every trainer",
        )

    def view(self) -> MapDataset:
        return self.dataset

    def begin_lease(self, lease: Lease) -> None:
        return None


class _ShardedView:
    """Samples of a sharded dataset by global index, read from the shard files ``locate``
    finds (the few most recently read shards stay open)."""

    def __init__(
        self,
        manifest: DatasetManifest,
        locate: Callable[[ShardInfo], Path | None],
        shards: tuple[ShardInfo, ...] | None = None,
    ) -> None:
        self.manifest = manifest
        self.locate = locate
        #: The shards viewed, in index order (default: the training shards).
        self.shards = manifest.shards if shards is None else shards
        self.starts: list[int] = []
        total = 0
        for shard in self.shards:
            self.starts.append(total)
            total += shard.samples
        self.total = total
        self._open: OrderedDict[str, ShardRows] = OrderedDict()

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: int) -> object:
        if not 0 <= index < self.total:
            raise IndexError(f"sample {index} is outside 0..{self.total - 1}")
        position = bisect.bisect_right(self.starts, index) - 1
        shard = self.shards[position]
        rows = self.rows(shard)
        return rows[index - self.starts[position]]

    def rows(self, shard: ShardInfo) -> ShardRows:
        rows = self._open.get(shard.name)
        if rows is not None:
            self._open.move_to_end(shard.name)
            return rows
        path = self.locate(shard)
        if path is None:
            raise ShardMissing(shard)
        opened = open_shard(path, shard=shard.name)
        if len(opened) != shard.samples:
            raise LocalError(
                f"shard {shard.name} holds {len(opened)} samples, the manifest says "
                f"{shard.samples}: the dataset was prepared wrongly; prepare it again"
            )
        self._open[shard.name] = opened
        while len(self._open) > _OPEN_SHARDS:
            self._open.popitem(last=False)
        return opened

    def forget(self, names: set[str]) -> None:
        """Close the shards named (their files are about to be deleted)."""
        for name in names:
            self._open.pop(name, None)


class ShardMissing(LocalError):
    """A shard of a prepared dataset is not on this machine (yet)."""

    def __init__(self, shard: ShardInfo) -> None:
        super().__init__(
            f"shard {shard.name} (blob {shard.blob_id[:12]}) is not on this machine; a "
            "trainer fetches the shards of its lease before training, an evaluator the "
            "validation shards before evaluating"
        )
        self.shard = shard


class ShardedData:
    """Prepared shard files (``p2ptrain data prepare``), one blob each: ``locate(shard)``
    is the shard's file on this machine, or None while it must still be fetched."""

    kind = "sharded"

    def __init__(
        self,
        manifest: DatasetManifest,
        locate: Callable[[ShardInfo], Path | None],
        *,
        location: str | None = None,
    ) -> None:
        if manifest.kind != "sharded":
            raise LocalError(
                f"dataset {manifest.name!r} is {manifest.kind}, not sharded: it has no shard "
                "files to fetch"
            )
        self.manifest = manifest
        self.location = location
        self._view = _ShardedView(manifest, locate)
        self._validation = (
            _ShardedView(manifest, locate, manifest.validation) if manifest.validation else None
        )

    def dataset_manifest(self) -> DatasetManifest:
        return self.manifest

    def describe(self) -> DataDescription:
        return DataDescription(
            kind=self.kind,
            descriptor=f"prepared shards {self.manifest.name!r}: {_shape(self.manifest)}, "
            f"{self.manifest.total_bytes / (1 << 20):,.1f} MiB",
            location=self.location,
        )

    def view(self) -> MapDataset:
        return self._view

    def validation_view(self) -> MapDataset | None:
        """The validation split's samples by index (its shards in manifest order), or None
        when the dataset has none."""
        return self._validation

    def begin_lease(self, lease: Lease) -> None:
        return None

    def forget(self, names: set[str]) -> None:
        self._view.forget(names)
        if self._validation is not None:
            self._validation.forget(names)


def _content_id(*parts: object) -> str:
    digest = hashlib.sha256(b"p2ptrain/v2/virtual-shard")
    for part in parts:
        encoded = str(part).encode()
        digest.update(b"%d:" % len(encoded) + encoded)
    return digest.hexdigest()


def _virtual_manifest(
    kind: str, name: str, samples: int, samples_per_shard: int, identity: str
) -> DatasetManifest:
    """Shards of a dataset whose samples are not hashed (generated, custom): each shard's id
    hashes what defines it, so two trainers with other definitions differ at shard 0."""
    if samples < 1 or samples_per_shard < 1:
        raise LocalError(
            f"{kind} dataset {name!r}: samples ({samples}) and samples_per_shard "
            f"({samples_per_shard}) must be positive"
        )
    count = -(-samples // samples_per_shard)
    shards = tuple(
        ShardInfo(
            name=f"{name}-{i:05d}",
            blob_id=_content_id(kind, name, identity, i, samples_per_shard, samples),
            samples=min(samples_per_shard, samples - i * samples_per_shard),
        )
        for i in range(count)
    )
    return DatasetManifest(name=name, shards=shards, kind=kind)


class _GeneratedView:
    def __init__(self, make: Callable[[int, torch.Generator], object], total: int, seed: int):
        self.make = make
        self.total = total
        self.seed = seed

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: int) -> object:
        if not 0 <= index < self.total:
            raise IndexError(f"sample {index} is outside 0..{self.total - 1}")
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (1 << 63))
        return self.make(index, generator)


class GeneratedData:
    """Samples made, not stored: sample ``i`` is ``make(i, generator)`` with a generator
    seeded from ``seed`` and ``i``. A lease's samples follow from (experiment, window, peer)
    through its indices, so every peer can make any trainer's data and no data moves.
    ``version`` names the generator's code: change it when ``make`` changes."""

    kind = "generated"

    def __init__(
        self,
        make: Callable[[int, torch.Generator], object],
        *,
        samples: int,
        name: str,
        samples_per_shard: int = 1024,
        seed: int = 0,
        version: str = "1",
    ) -> None:
        if not callable(make):
            raise LocalError("GeneratedData needs make(index, generator) -> sample")
        self.name = name
        self.seed = seed
        self.version = version
        self._manifest = _virtual_manifest(
            self.kind, name, samples, samples_per_shard, f"seed={seed}/version={version}"
        )
        self._view = _GeneratedView(make, samples, seed)

    def dataset_manifest(self) -> DatasetManifest:
        return self._manifest

    def describe(self) -> DataDescription:
        maker = getattr(self._view.make, "__qualname__", type(self._view.make).__name__)
        return DataDescription(
            kind=self.kind,
            descriptor=f"generated {self.name!r} by {maker} (seed {self.seed}, version "
            f"{self.version}): {_shape(self._manifest)}",
            location=None,
        )

    def view(self) -> MapDataset:
        return self._view

    def begin_lease(self, lease: Lease) -> None:
        return None


class _LeaseView:
    def __init__(self, total: int) -> None:
        self.total = total
        self.window: int | None = None
        self.samples: dict[int, object] = {}

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: int) -> object:
        try:
            return self.samples[index]
        except KeyError:
            raise LocalError(
                f"custom data: sample {index} is not in the lease of window {self.window}; "
                "the load callback gives one lease's samples at a time"
            ) from None


class CustomData:
    """A user callback gives the samples of a lease: ``load(lease, indices)`` returns them
    in the order of ``indices`` (the lease's global indices, see
    :func:`~p2ptrain.data.shards.lease_indices`). ``identity`` names the data the callback
    serves (a dataset version, a query): trainers with another identity differ at shard 0."""

    kind = "custom"

    def __init__(
        self,
        load: Callable[[Lease, list[int]], Sequence[Any]],
        *,
        samples: int,
        name: str,
        samples_per_shard: int = 1024,
        identity: str = "",
        location: str | None = None,
    ) -> None:
        if not callable(load):
            raise LocalError("CustomData needs load(lease, indices) -> samples")
        self.load = load
        self.name = name
        self.location = location
        self._manifest = _virtual_manifest(self.kind, name, samples, samples_per_shard, identity)
        self._view = _LeaseView(samples)

    def dataset_manifest(self) -> DatasetManifest:
        return self._manifest

    def describe(self) -> DataDescription:
        loader = getattr(self.load, "__qualname__", type(self.load).__name__)
        return DataDescription(
            kind=self.kind,
            descriptor=f"custom {self.name!r} loaded by {loader}: {_shape(self._manifest)}",
            location=self.location,
        )

    def view(self) -> MapDataset:
        return self._view

    def begin_lease(self, lease: Lease) -> None:
        indices = lease_indices(self._manifest, lease)
        samples = list(self.load(lease, indices))
        if len(samples) != len(indices):
            raise LocalError(
                f"custom data {self.name!r}: load() returned {len(samples)} samples for the "
                f"lease of window {lease.window}, which holds {len(indices)}; return one "
                "sample per index, in order"
            )
        self._view.window = lease.window
        self._view.samples = dict(zip(indices, samples, strict=True))


def as_pipeline(train: object, *, name: str, samples_per_shard: int) -> DataPipeline:
    """A workload's training data as a pipeline: a pipeline as it is, a map-style dataset
    as ``indexed``; an iterable dataset is refused with what to do instead."""
    if isinstance(train, DataPipeline):
        return train
    if hasattr(train, "__len__") and hasattr(train, "__getitem__"):
        return IndexedData(train, name=name, samples_per_shard=samples_per_shard)
    if hasattr(train, "__iter__"):
        raise LocalError(
            f"the training data ({type(train).__name__}) is iterable but not indexable: leases "
            "name samples by index. Prepare it into shards (p2ptrain data prepare, or "
            "p2ptrain.data.prepare.prepare_dataset(dataset, out)) and name the result in the "
            'experiment definition ([data] prepared = "DIR")'
        )
    raise LocalError(
        f"the training data is a {type(train).__name__}: give a map-style dataset (len() and "
        "dataset[i]), an IndexedData/GeneratedData/CustomData pipeline, or prepared shards"
    )
