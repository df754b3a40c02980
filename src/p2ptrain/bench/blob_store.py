"""Blob store throughput as a ratio to plain file I/O of the same bytes, in the same run.

* ``blob_put_ratio``: :meth:`BlobStore.put` (hash, write, fsync, rename, fsync directory)
  against writing the bytes to a file and fsyncing it.
* ``blob_get_ratio``: :meth:`BlobStore.get` (read and verify the hash) against reading the
  file; both files are in the page cache.
* ``blob_put_ratio_vs_unsynced_write``: put against a write with no fsync, for honesty.

Each measurement is the best of ``repeats``; the contenders alternate within each repeat so
a noisy neighbour slows them alike. A ratio of 1.0 means "as fast as plain I/O".
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from p2ptrain.store.blobs import BlobStore

__all__ = ["measure_blob_store"]

_MB = 1e6


def measure_blob_store(
    size_bytes: int = 100 * 1024 * 1024, repeats: int = 3, workdir: str | None = None
) -> dict[str, float]:
    """Measure put/get of one ``size_bytes`` blob of random bytes; see the module docstring."""
    if size_bytes <= 0 or repeats <= 0:
        raise ValueError(f"size_bytes and repeats must be positive, got {size_bytes}, {repeats}")
    data = os.urandom(size_bytes)
    with tempfile.TemporaryDirectory(prefix="p2ptrain-bench-", dir=workdir) as scratch:
        root = Path(scratch)
        with BlobStore(root / "blobs") as store:
            best = _measure(store, root, data, repeats)
    mb = size_bytes / _MB
    result = {
        "blob_put_mb_s": mb / best["put"],
        "blob_plain_write_mb_s": mb / best["plain_write"],
        "blob_unsynced_write_mb_s": mb / best["unsynced_write"],
        "blob_get_mb_s": mb / best["get"],
        "blob_plain_read_mb_s": mb / best["plain_read"],
    }
    result["blob_put_ratio"] = best["plain_write"] / best["put"]
    result["blob_put_ratio_vs_unsynced_write"] = best["unsynced_write"] / best["put"]
    result["blob_get_ratio"] = best["plain_read"] / best["get"]
    return result


def _measure(store: BlobStore, scratch: Path, data: bytes, repeats: int) -> dict[str, float]:
    """Best seconds of each contender over ``repeats`` interleaved rounds.

    Writers always create a new file (the blob is deleted, the plain file unlinked, outside
    the timed region), so neither pays for truncating an old one; ``os.sync()`` before each
    timing keeps earlier writeback (and discards on filesystems mounted with ``discard``)
    out of the next measurement.
    """
    written, cached = scratch / "plain-write", scratch / "plain-read"
    blob = store.put(data)
    _write(cached, data, sync=True)
    _read(cached)  # both files to be read are now in the page cache
    store.get(blob)
    contenders: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "plain_write": (lambda: _write(written, data, sync=True), written.unlink),
        "put": (lambda: store.put(data), lambda: store.delete(blob)),
        "unsynced_write": (lambda: _write(written, data, sync=False), written.unlink),
        "plain_read": (lambda: _read(cached), lambda: None),
        "get": (lambda: store.get(blob), lambda: None),
    }
    written.touch()
    best = dict.fromkeys(contenders, float("inf"))
    for _ in range(repeats):
        for name, (run, prepare) in contenders.items():
            prepare()
            os.sync()  # settle writeback and discards of freed blocks before timing
            best[name] = min(best[name], _seconds(run))
    return best


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - start
    del result  # free a read's copy outside the timed region
    return elapsed


def _write(path: Path, data: bytes, *, sync: bool) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        if sync:
            os.fsync(file.fileno())


def _read(path: Path) -> bytes:
    with open(path, "rb") as file:
        return file.read()
