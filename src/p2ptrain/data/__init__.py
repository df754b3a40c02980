"""Training data: shard manifests of map-style datasets, prepared (sharded) datasets, the
bundled Shakespeare corpus, and scikit-learn's digits for the simulator and the benchmarks
(:mod:`.digits`).

A dataset is split into shards whose names, sample counts and content hashes go into the
experiment manifest (DESIGN §3), so every peer agrees on what a lease means and can check
that it holds the same samples as everyone else. An ``indexed`` dataset is one every trainer
holds (:mod:`.shards`); a ``sharded`` one is prepared once into shard files
(:mod:`.prepare`, :mod:`.shard_format`, docs/data.md) that trainers fetch by hash.
"""

from __future__ import annotations

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
