"""Training data: shard manifests of map-style datasets, the bundled Shakespeare corpus, and
scikit-learn's digits for the simulator and the benchmarks (:mod:`.digits`).

A dataset is split into fixed-size shards whose names, sample counts and content hashes go
into the experiment manifest (DESIGN §3), so every peer agrees on what a lease means and can
check that it holds the same samples as everyone else.
"""

from __future__ import annotations

from p2ptrain.data.shards import dataset_manifest, lease_indices, shard_blob_id

__all__ = ["dataset_manifest", "lease_indices", "shard_blob_id"]
