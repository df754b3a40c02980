"""Training data: shard manifests of map-style datasets, prepared (sharded) datasets, the
bundled Shakespeare corpus, and scikit-learn's digits for the simulator and the benchmarks
(:mod:`.digits`).

A dataset is split into shards whose names, sample counts and content hashes go into the
experiment manifest (DESIGN §3), so every peer agrees on what a lease means and can check
that it holds the same samples as everyone else. An ``indexed`` dataset is one every trainer
holds (:mod:`.shards`); a ``sharded`` one is prepared once into shard files
(:mod:`.prepare`, :mod:`.shard_format`, docs/data.md) that trainers fetch by hash.

The names below are imported when first asked for, so that reading a prepared dataset's
manifest (``p2ptrain data show``) does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2ptrain.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from p2ptrain.data.prepare import PreparedDataset, prepare_dataset, read_prepared
    from p2ptrain.data.shard_format import (
        MalformedShard,
        ShardRows,
        decode_shard,
        encode_shard,
        open_shard,
    )
    from p2ptrain.data.shards import dataset_manifest, lease_indices, shard_blob_id

__all__ = [
    "MalformedShard",
    "PreparedDataset",
    "ShardRows",
    "dataset_manifest",
    "decode_shard",
    "encode_shard",
    "lease_indices",
    "open_shard",
    "prepare_dataset",
    "read_prepared",
    "shard_blob_id",
]

#: Where each name of ``__all__`` is defined.
_MODULE_OF = {
    "PreparedDataset": "prepare",
    "prepare_dataset": "prepare",
    "read_prepared": "prepare",
    "MalformedShard": "shard_format",
    "ShardRows": "shard_format",
    "decode_shard": "shard_format",
    "encode_shard": "shard_format",
    "open_shard": "shard_format",
    "dataset_manifest": "shards",
    "lease_indices": "shards",
    "shard_blob_id": "shards",
}


__getattr__ = lazy_exports(__name__, _MODULE_OF)
