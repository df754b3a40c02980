"""A trainer's shards of a ``sharded`` dataset: which it holds, fetched when a lease needs them,
verified, and evicted least recently leased first once they pass the cache's size.

Shards are blobs in the node's blob store (named by the hash the manifest lists), so the node
serves the shards it holds to other trainers like any blob. The cache records, in
``data-cache.json`` of the data directory, the order in which shards were last leased; a
restarted trainer evicts in the same order. A shard on disk is hashed once per process before
it is read (a file may rot while the node is down); one that no longer matches is deleted and
fetched again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from p2ptrain.core.manifests import DatasetManifest, ShardInfo
from p2ptrain.errors import BlobCorrupted, BlobNotFound, LocalError
from p2ptrain.observe.status import DataStatus
from p2ptrain.store.atomic import write_atomically
from p2ptrain.store.blobs import BlobStore

__all__ = ["CACHE_FILE", "ShardCache"]

logger = logging.getLogger(__name__)

CACHE_FILE = "data-cache.json"


class ShardCache:
    """The shards of ``manifest`` this node holds in ``blobs`` (see the module docstring);
    ``limit_bytes`` None keeps every shard (a seed, a mirror)."""

    def __init__(
        self,
        blobs: BlobStore,
        manifest: DatasetManifest,
        record: Path,
        *,
        limit_bytes: int | None,
    ) -> None:
        self.blobs = blobs
        self.manifest = manifest
        self.record = record
        self.limit_bytes = limit_bytes
        self._by_name = {shard.name: shard for shard in manifest.shards}
        self._verified: set[str] = set()
        self._order: dict[str, int] = self._read_order()
        self._clock = max(self._order.values(), default=0)
        self._leased: set[str] = set()
        #: Names of the shards on disk (one scan now; kept up to date after).
        self._held = {s.name for s in manifest.shards if blobs.has(s.blob_id)}
        self.fetched_shards = 0
        self.downloaded_bytes = 0
        self.evicted_shards = 0
        #: Told the names of the shards evicted (a reader closes its handles on them).
        self.on_evict: Callable[[set[str]], None] = lambda names: None

    def _read_order(self) -> dict[str, int]:
        try:
            raw = json.loads(self.record.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning(
                "%s is unreadable (%s); starting the shard order afresh", self.record, exc
            )
            return {}
        leased = raw.get("leased", {}) if isinstance(raw, dict) else {}
        if not isinstance(leased, dict):
            return {}
        return {
            name: int(when)
            for name, when in leased.items()
            if name in self._by_name and isinstance(when, int)
        }

    def shard(self, name: str) -> ShardInfo:
        return self._by_name[name]

    def locate(self, shard: ShardInfo) -> Path | None:
        """The shard's file, when this node holds it."""
        return self.blobs.path(shard.blob_id) if self.blobs.has(shard.blob_id) else None

    def held(self, shard: ShardInfo) -> bool:
        """Whether the shard is on disk and hashes to its id (hashed once per process; a
        shard that does not is moved aside by the store, to be fetched again). Blocking:
        call off the loop."""
        if shard.name in self._verified and self.blobs.has(shard.blob_id):
            return True
        try:
            for _ in self.blobs.iter_chunks(shard.blob_id):  # hashed as it is read
                pass
        except BlobNotFound:
            self._held.discard(shard.name)
            return False
        except BlobCorrupted:  # moved aside by the store
            logger.warning(
                "shard %s on disk no longer matches its hash; fetching it again", shard.name
            )
            self._held.discard(shard.name)
            return False
        self._verified.add(shard.name)
        self._held.add(shard.name)
        return True

    def fetched(self, shard: ShardInfo, downloaded: int) -> None:
        """A shard arrived (verified by the fetcher) with ``downloaded`` bytes from peers."""
        self._verified.add(shard.name)
        self._held.add(shard.name)
        self.fetched_shards += 1
        self.downloaded_bytes += downloaded

    def leased(self, names: Iterable[str]) -> set[str]:
        """A lease named ``names``: they become the most recently leased; shards beyond the
        limit are evicted, least recently leased first (never these). Returns the names
        evicted."""
        chosen = [name for name in names if name in self._by_name]
        for name in chosen:
            if self.blobs.has(self._by_name[name].blob_id):
                self._held.add(name)
            self._clock += 1
            self._order[name] = self._clock
            self._leased.add(name)
        evicted = self._evict(set(chosen))
        self._save()
        if evicted:
            self.on_evict(evicted)
        return evicted

    def _evict(self, keep: set[str]) -> set[str]:
        if self.limit_bytes is None:
            return set()
        total = sum(self._by_name[name].bytes for name in self._held)
        evicted: set[str] = set()
        order = sorted(self._held, key=lambda name: (self._order.get(name, 0), name))
        for shard in (self._by_name[name] for name in order):
            if total <= self.limit_bytes:
                break
            if shard.name in keep:
                continue
            self.blobs.delete(shard.blob_id)
            self._verified.discard(shard.name)
            self._held.discard(shard.name)
            self._order.pop(shard.name, None)
            total -= shard.bytes
            evicted.add(shard.name)
        self.evicted_shards += len(evicted)
        if evicted:
            logger.info(
                "evicted %d shard(s) to keep the data cache under %d bytes",
                len(evicted),
                self.limit_bytes,
            )
        return evicted

    def _save(self) -> None:
        data = json.dumps({"leased": self._order}, sort_keys=True).encode()
        try:
            write_atomically(self.record, data)
        except LocalError as exc:  # the order is a hint: losing it costs a worse eviction
            logger.warning("cannot record the shard order in %s: %s", self.record, exc)

    def status(self, kind: str, descriptor: str, location: str | None) -> DataStatus:
        return DataStatus(
            kind=kind,
            descriptor=descriptor,
            location=location,
            shards_held=len(self._held),
            bytes_held=sum(self._by_name[name].bytes for name in self._held),
            cache_limit_bytes=self.limit_bytes,
            fetched_shards=self.fetched_shards,
            downloaded_bytes=self.downloaded_bytes,
            leased_shards=len(self._leased),
            leased_bytes=sum(self._by_name[name].bytes for name in self._leased),
            evicted_shards=self.evicted_shards,
        )
