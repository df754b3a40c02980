"""A prepared dataset's shard files into a node's blob store, so the node serves them.

A seed imports the dataset its experiment definition names (``[data] prepared = "DIR"``) and
any node run with ``--data DIR`` imports that one; trainers then fetch the shards their
leases name from them, and from each other, with the blob transfer (verified by hash), and
evaluators fetch the validation split's shards the same way. Each
file is hashed as it is copied: one that changed since ``p2ptrain data prepare`` wrote it is
refused by name, so a node never serves a shard under a hash it does not have.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from p2ptrain.core.manifests import DatasetManifest, ShardInfo
from p2ptrain.data.pipelines import ShardedData
from p2ptrain.data.prepare import PreparedDataset
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.store.blobs import BlobStore
from p2ptrain.torch.capabilities import PreparedDataUser
from p2ptrain.torch.workload import Workload

__all__ = ["attach_validation", "import_prepared"]

logger = logging.getLogger(__name__)


def import_prepared(
    blobs: BlobStore, prepared: PreparedDataset, expected: DatasetManifest | None = None
) -> int:
    """Copy the shards of ``prepared`` that ``blobs`` lacks into it (hashing each); return
    the bytes copied. ``expected``: the experiment's dataset, which ``prepared`` must be."""
    if expected is not None and prepared.manifest != expected:
        raise LocalError(
            f"the prepared dataset in {prepared.path} ({prepared.manifest.name}, "
            f"{len(prepared.manifest.shards)} shards) is not the experiment's dataset "
            f"({expected.name}, {len(expected.shards)} shards): pass the directory the "
            "experiment was created from"
        )
    started = time.monotonic()
    copied = 0
    for shard in prepared.manifest.all_shards:  # the validation split's too
        if blobs.has(shard.blob_id):
            continue
        path = prepared.shard_path(shard.name)
        try:
            with path.open("rb") as file:
                blobs.put_stream(file, expected_id=shard.blob_id, max_bytes=shard.bytes)
        except ProtocolViolation as exc:
            raise LocalError(
                f"shard {shard.name} ({path}) no longer matches the hash p2ptrain data prepare "
                f"recorded ({shard.blob_id[:12]}): the file changed; prepare the dataset again"
            ) from exc
        except OSError as exc:
            raise LocalError(f"cannot read shard {shard.name} at {path}: {exc}") from exc
        copied += shard.bytes
    if copied:
        logger.info(
            "imported %d MiB of shards of %s in %.1f s",
            copied >> 20,
            prepared.manifest.name,
            time.monotonic() - started,
        )
    return copied


def attach_validation(workload: Workload, dataset: DatasetManifest, blobs: BlobStore) -> str | None:
    """Give a workload that validates on the prepared data's split (``val_from_data``, the
    built-in language models on prepared text) the experiment's shards as ``blobs`` holds
    them (an evaluator fetches the validation shards it lacks before it evaluates); return
    why the workload has no validation data (None: it has some)."""
    if not isinstance(workload, PreparedDataUser):
        return None
    if workload.val_from_data and dataset.kind == "sharded":

        def locate(shard: ShardInfo) -> Path | None:
            return blobs.path(shard.blob_id) if blobs.has(shard.blob_id) else None

        workload.use_data(ShardedData(dataset, locate, location=str(blobs.root)))
    return workload.validation_missing or None
