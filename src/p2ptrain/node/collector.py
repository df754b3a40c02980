"""Blob garbage collection: a node's disk stays bounded (DESIGN §6).

After each certified head the node adopts (and once when it starts) it asks for a pass
(:meth:`BlobCollector.request`); the collector takes a snapshot of what the node keeps on
the event loop (:meth:`BlobCollector.snapshot`, the rule is
:mod:`p2ptrain.protocol.retention`'s), then lists the blob store on a worker thread,
deletes what the rule releases and removes abandoned partial downloads
(:func:`p2ptrain.net.partial_file.remove_partial`: never one being downloaded). One pass
at a time; passes asked for while one runs become one more pass. A pass that fails is
logged as a warning (a full or failing disk is reported once, like any storage fault)
and counted, and the next adoption tries again: it never ends the node.

Which blobs are updates of which window the collector learns from every update record
the node sees (:meth:`saw_update`: gossip, and the records its roles keep). A blob it was
never told of -- left from before a restart, an update whose record never came -- is
deleted once it is older than the grace, so nothing stays for good. Data shards and the
genesis weights are pinned: never deleted here (the shard cache evicts shards itself).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from p2ptrain.core.records import Head, Update
from p2ptrain.driver.storage import StorageHealth
from p2ptrain.errors import BlobNotFound
from p2ptrain.net.partial_file import PARTIAL_DIR, partial_downloads, remove_partial
from p2ptrain.protocol.retention import (
    UPDATE_WINDOWS_KEPT,
    KeepSet,
    blob_verdict,
    keep_set,
    partial_verdict,
    unknown_verdict,
)
from p2ptrain.store.blobs import BlobStore

__all__ = ["BlobCollector", "CollectorStatistics", "Pass"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pass:
    """What one pass did: at which height, what it deleted, and why (reason -> count)."""

    height: int
    blobs: int = 0
    bytes: int = 0
    partials: int = 0
    partial_bytes: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def describe(self) -> str:
        why = ", ".join(f"{count} {reason}" for reason, count in sorted(self.reasons.items()))
        return (
            f"height {self.height}: collected {self.blobs} blob(s), {self.bytes} bytes"
            f"{f' ({why})' if why else ''}, and {self.partials} partial download(s), "
            f"{self.partial_bytes} bytes, in {self.seconds:.3f} s"
        )


@dataclass(frozen=True, slots=True)
class CollectorStatistics:
    """Since the node started."""

    passes: int = 0
    blobs_collected: int = 0
    bytes_collected: int = 0
    partials_removed: int = 0
    #: Passes that failed (logged; the next adoption tries again).
    failures: int = 0
    #: The height of the last pass that completed.
    height: int = 0


class BlobCollector:
    """Deletes the blobs a node no longer needs (see the module docstring).

    ``keep_heads``: the certified heads whose blobs are kept; ``pinned``: never deleted
    (:func:`~p2ptrain.protocol.retention.pinned_blobs`); ``grace_s``: how long a blob the
    node knows nothing of is kept (:func:`~p2ptrain.protocol.retention.unknown_grace_s`);
    ``clock``: the wall clock files are dated by.
    """

    def __init__(
        self,
        blobs: BlobStore,
        *,
        keep_heads: int,
        pinned: Iterable[str],
        grace_s: float,
        storage: StorageHealth | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.blobs = blobs
        self.keep_heads = keep_heads
        self.pinned = frozenset(pinned)
        self.grace_s = grace_s
        self.storage = storage or StorageHealth(str(blobs.root))
        self._clock = clock
        #: Update blobs the node was told of, with their window (until released).
        self._windows: dict[str, int] = {}
        #: Heads below this height were released by an earlier snapshot.
        self._heads_from = 0
        self._wanted = asyncio.Event()
        self._lock = threading.Lock()
        self._statistics = CollectorStatistics()

    # -- what the node tells it (on the event loop) ---------------------------------------

    def saw_update(self, update: Update) -> None:
        """An update record the node took: its blob belongs to its window."""
        window = self._windows.get(update.delta_blob, 0)
        self._windows[update.delta_blob] = max(window, update.window)

    def request(self) -> None:
        """Ask for a pass (after an adoption): :meth:`run` starts one soon."""
        self._wanted.set()

    def snapshot(
        self,
        height: int,
        head_at: Callable[[int], Head | None],
        in_use: Iterable[Head],
        sending: Iterable[str] = (),
    ) -> KeepSet:
        """The keep set at ``height`` (the node's highest certified head; ``head_at`` its
        chain's head at a height, ``in_use`` the heads its roles build on, ``sending`` our
        update blobs still being pushed). Updates and
        heads released here are forgotten: if their pass fails they are collected later,
        as blobs the node knows nothing of."""
        heights = range(self._heads_from, height + 1)
        heads = [head for h in heights if (head := head_at(h)) is not None]
        keep = keep_set(
            height=height,
            keep_heads=self.keep_heads,
            heads=heads,
            in_use=in_use,
            updates=[(window, blob) for blob, window in self._windows.items()],
            pinned=self.pinned,
            sending=sending,
        )
        floor = height - UPDATE_WINDOWS_KEPT
        self._windows = {blob: w for blob, w in self._windows.items() if w > floor}
        self._heads_from = max(self._heads_from, height - self.keep_heads + 1)
        return keep

    def statistics(self) -> CollectorStatistics:
        with self._lock:
            return self._statistics

    # -- passes ---------------------------------------------------------------------------

    async def run(self, snapshot: Callable[[], KeepSet]) -> None:
        """Run a pass whenever one was asked for, until cancelled (a pass under way ends
        first: its thread deletes files of a store that is about to close)."""
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            keep: KeepSet | None = None
            try:
                keep = snapshot()
                running = asyncio.ensure_future(asyncio.to_thread(self.collect, keep))
                try:
                    await asyncio.shield(running)
                except asyncio.CancelledError:
                    await asyncio.wait([running])
                    raise
            except Exception as exc:  # never the end of the node: the next pass tries again
                self.failed(exc, None if keep is None else keep.height)

    def collect(self, keep: KeepSet) -> Pass:
        """One pass over the store against ``keep`` (blocking: run it on a worker thread)."""
        started = time.monotonic()
        now = self._clock()
        reasons: Counter[str] = Counter()
        blobs = freed = 0
        for blob_id in list(self.blobs.ids()):
            verdict = blob_verdict(blob_id, keep)
            if verdict is not None and not verdict.delete:
                continue
            try:
                status = self.blobs.path(blob_id).stat()
            except (FileNotFoundError, BlobNotFound):
                continue  # gone meanwhile (the shard cache evicts on its own)
            if verdict is None:
                verdict = unknown_verdict(now - status.st_mtime, self.grace_s)
            if verdict.delete and self.blobs.delete(blob_id):
                blobs += 1
                freed += status.st_size
                reasons[verdict.reason] += 1
        partials = partial_bytes = 0
        directory = self.blobs.root / PARTIAL_DIR
        for download in partial_downloads(directory):
            verdict = partial_verdict(
                download.blob_id,
                now - download.modified,
                held=self.blobs.has(download.blob_id),
                keep=keep,
                grace_s=self.grace_s,
            )
            if verdict.delete and remove_partial(
                download, directory, unless_newer=download.modified
            ):
                partials += 1
                partial_bytes += download.bytes
                reasons[verdict.reason] += 1
        done = Pass(
            height=keep.height,
            blobs=blobs,
            bytes=freed,
            partials=partials,
            partial_bytes=partial_bytes,
            reasons=dict(reasons),
            seconds=round(time.monotonic() - started, 3),
        )
        self.blobs.usage()  # counted here, off the loop, the first time
        with self._lock:
            s = self._statistics
            self._statistics = replace(
                s,
                passes=s.passes + 1,
                blobs_collected=s.blobs_collected + blobs,
                bytes_collected=s.bytes_collected + freed,
                partials_removed=s.partials_removed + partials,
                height=keep.height,
            )
        logger.debug("blob collection, %s", done.describe())
        return done

    def failed(self, exc: BaseException, height: int | None) -> None:
        """A pass failed: say so (a storage fault once) and count it."""
        with self._lock:
            self._statistics = replace(self._statistics, failures=self._statistics.failures + 1)
        where = "collecting blobs" if height is None else f"collecting blobs at height {height}"
        if not self.storage.check(where, exc):
            logger.warning("%s failed: %s: %s", where, type(exc).__name__, exc)
