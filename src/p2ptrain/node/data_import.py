"""A prepared dataset's shard files into a node's blob store, so the node serves them.

A seed imports the dataset its experiment definition names (``[data] prepared = "DIR"``) and
any node run with ``--data DIR`` imports that one; trainers then fetch the shards their
leases name from them, and from each other, with the blob transfer (verified by hash). Each
file is hashed as it is copied: one that changed since ``p2ptrain data prepare`` wrote it is
refused by name, so a node never serves a shard under a hash it does not have.
"""

from __future__ import annotations

import logging
import time

from p2ptrain.core.manifests import DatasetManifest
from p2ptrain.data.prepare import PreparedDataset
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.store.blobs import BlobStore

__all__ = ["import_prepared"]

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
    for shard in prepared.manifest.shards:
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
