"""What a node keeps in its blob store, and what it deletes (DESIGN §6: bounded disk).

A node keeps:

* **pinned** blobs, never collected: the genesis weights (joining and catch-up start from
  genesis) and every shard blob the experiment's dataset names (the shard cache evicts
  those itself, :mod:`p2ptrain.node.shard_cache`);
* the blobs of the last ``keep_heads`` certified heads it holds and of the heads its roles
  build on: every blob a head names (:func:`head_blob_ids`);
* the update blobs of windows above ``height - UPDATE_WINDOWS_KEPT``: the open window's,
  those of windows not certified yet, and the last certified window's (peers a window behind
  still fetch them);
* the node's own update blobs it is still sending (an outbound-only trainer's push being
  retried), whatever their window;
* a blob it knows nothing of (a download that just finished, an update pushed to it whose
  record has not arrived yet, a head fetched for a catch-up not adopted yet) until it was
  last written ``grace_s`` ago (:func:`unknown_grace_s`).

Everything else goes: the blobs of older heads and the updates of older windows at once,
other blobs once they are older than the grace. A partial download (``blobs/partial/<id>``
and its records) goes when nobody is downloading it, it was not written for ``grace_s``, and
its blob is held already, is not wanted, or it has not been touched for
``PARTIAL_MAX_AGE_S``. An archive node (``--archive``) keeps everything.

Pure: the node lists its store and asks :func:`blob_verdict`, :func:`unknown_verdict` and
:func:`partial_verdict`; :mod:`p2ptrain.node.collector` deletes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2ptrain.errors import LocalError

if TYPE_CHECKING:  # annotations only: the command line reads DEFAULT_KEEP_HEADS
    from p2ptrain.core.manifests import ExperimentManifest, WindowSpec
    from p2ptrain.core.records import Head

__all__ = [
    "DEFAULT_KEEP_HEADS",
    "MIN_GRACE_S",
    "PARTIAL_MAX_AGE_S",
    "UPDATE_WINDOWS_KEPT",
    "Disposal",
    "KeepSet",
    "blob_verdict",
    "head_blob_ids",
    "keep_set",
    "partial_verdict",
    "pinned_blobs",
    "unknown_grace_s",
    "unknown_verdict",
]

#: Certified heads whose blobs a node keeps by default (``--keep-heads``), genesis aside.
DEFAULT_KEEP_HEADS = 3
#: Update blobs of windows above ``height - UPDATE_WINDOWS_KEPT`` are kept.
UPDATE_WINDOWS_KEPT = 2
#: The shortest grace of a blob the node knows nothing of.
MIN_GRACE_S = 10.0
#: A partial download of a wanted blob that nobody touched for this long is removed.
PARTIAL_MAX_AGE_S = 3600.0

# Why a blob stays or goes (counted by reason in the collector's log line).
PINNED = "genesis or a dataset shard"
RECENT_HEAD = "named by a recent head"
PENDING_UPDATE = "an update of a recent or pending window"
SENDING = "an update of ours still being pushed"
OLD_HEAD = "named only by an older head"
OLD_UPDATE = "an update of an older window"
YOUNG = "unknown, written within the grace"
STALE = "unknown, older than the grace"
DOWNLOADED = "a leftover of a finished download"
UNWANTED = "a download of a blob no longer wanted"
ABANDONED = "a download untouched for too long"
RESUMABLE = "a download of a wanted blob, kept to resume"


@dataclass(frozen=True, slots=True)
class Disposal:
    """Whether a blob (or a partial download) is deleted, and why."""

    delete: bool
    reason: str


@dataclass(frozen=True, slots=True)
class KeepSet:
    """What a node keeps at ``height``, and what it knows it no longer needs."""

    height: int
    pinned: frozenset[str]
    heads: frozenset[str]
    updates: frozenset[str]
    #: Blobs of heads below the last ``keep_heads`` and updates of older windows.
    old_heads: frozenset[str] = frozenset()
    old_updates: frozenset[str] = frozenset()
    #: The node's own update blobs it is still pushing to a peer.
    sending: frozenset[str] = frozenset()

    def wanted(self, blob_id: str) -> bool:
        return any(
            blob_id in kept for kept in (self.pinned, self.heads, self.updates, self.sending)
        )


def head_blob_ids(head: Head) -> tuple[str, ...]:
    """Every blob ``head`` names: its weights, its outer-optimizer state and any other blob
    a head carries (an ``aggregate_blob``, where heads have one)."""
    named = (head.weights_blob, head.optimizer_blob, head.aggregate_blob)
    return tuple(dict.fromkeys(b for b in named if isinstance(b, str)))


def pinned_blobs(manifest: ExperimentManifest) -> frozenset[str]:
    """The blobs a node never collects: genesis and the dataset's shards (its validation
    shards included)."""
    shards = manifest.dataset.all_shards
    return frozenset([manifest.genesis_weights, *(s.blob_id for s in shards)])


def unknown_grace_s(window: WindowSpec) -> float:
    """How long a blob the node knows nothing of is kept after it was last written: two
    windows' deadline and proposal slot (an update pushed before its record arrives lives
    that long at most), and never less than :data:`MIN_GRACE_S`."""
    return max(MIN_GRACE_S, 2.0 * (window.deadline_s + window.proposal_s))


def keep_set(
    *,
    height: int,
    keep_heads: int,
    heads: Iterable[Head],
    in_use: Iterable[Head] = (),
    updates: Iterable[tuple[int, str]] = (),
    pinned: Iterable[str] = (),
    sending: Iterable[str] = (),
) -> KeepSet:
    """The keep set at ``height`` (the node's highest certified head).

    ``heads``: certified heads the node holds -- any that include the last ``keep_heads``
    (those below them are released); ``in_use``: the heads its roles build on (kept
    whatever their height); ``updates``: ``(window, delta blob)`` of the updates it knows;
    ``pinned``: :func:`pinned_blobs`; ``sending``: our update blobs still being pushed.
    """
    if keep_heads < 1:
        raise LocalError(f"keep_heads={keep_heads}: keep at least the last head (1 or more)")
    floor = height - keep_heads  # heads above it are kept
    kept_heads: set[str] = set()
    old_heads: set[str] = set()
    for head in heads:
        (kept_heads if head.height > floor else old_heads).update(head_blob_ids(head))
    for head in in_use:
        kept_heads.update(head_blob_ids(head))
    kept_updates: set[str] = set()
    old_updates: set[str] = set()
    for window, blob in updates:
        (kept_updates if window > height - UPDATE_WINDOWS_KEPT else old_updates).add(blob)
    return KeepSet(
        height=height,
        pinned=frozenset(pinned),
        heads=frozenset(kept_heads),
        updates=frozenset(kept_updates),
        old_heads=frozenset(old_heads),
        old_updates=frozenset(old_updates),
        sending=frozenset(sending),
    )


def blob_verdict(blob_id: str, keep: KeepSet) -> Disposal | None:
    """Keep or delete a held blob the node knows, and why; None for a blob it knows
    nothing of (ask :func:`unknown_verdict` with its age). What is kept wins over what is
    released: one blob may be both an old head's and a recent one's."""
    if blob_id in keep.pinned:
        return Disposal(False, PINNED)
    if blob_id in keep.heads:
        return Disposal(False, RECENT_HEAD)
    if blob_id in keep.updates:
        return Disposal(False, PENDING_UPDATE)
    if blob_id in keep.sending:
        return Disposal(False, SENDING)
    if blob_id in keep.old_heads:
        return Disposal(True, OLD_HEAD)
    if blob_id in keep.old_updates:
        return Disposal(True, OLD_UPDATE)
    return None


def unknown_verdict(age_s: float, grace_s: float) -> Disposal:
    """A blob the node knows nothing of, last written ``age_s`` ago."""
    return Disposal(True, STALE) if age_s >= grace_s else Disposal(False, YOUNG)


def partial_verdict(
    blob_id: str,
    age_s: float,
    *,
    held: bool,
    keep: KeepSet,
    grace_s: float,
    max_age_s: float = PARTIAL_MAX_AGE_S,
) -> Disposal:
    """A partial download of ``blob_id`` that nobody downloads now (the caller checks),
    last written ``age_s`` ago; ``held``: the store holds the blob already."""
    if age_s < grace_s:
        return Disposal(False, YOUNG)  # it may have only just begun
    if held:
        return Disposal(True, DOWNLOADED)
    if not keep.wanted(blob_id):
        return Disposal(True, UNWANTED)
    if age_s >= max_age_s:
        return Disposal(True, ABANDONED)
    return Disposal(False, RESUMABLE)
