"""Leases: which samples a trainer trains on in a window, computed rather than granted.

For a trainer ``p`` and window ``w`` every shard ``s`` of the experiment's dataset gets the
score ``SHA-256("p2ptrain/v2/lease" 0 experiment 0 w 0 s 0 p)`` (rendezvous hashing); the
trainer takes shards in ascending score order until it holds ``lease_size`` samples: every
sample of each shard but the last, and of the last only as many as it needs. Those are
``count`` consecutive samples from ``start``, wrapping around the end of the shard, where
``start`` is ``SHA-256("p2ptrain/v2/lease-start" 0 experiment 0 w 0 s 0 p)`` read as a
256-bit big-endian integer, modulo the shard's sample count (a shard taken whole starts at
0). So every sample of a shard is as likely to be leased as any other, and a lease smaller
than a shard still reaches all of it over the windows.

Anyone can recompute a lease, so a trainer cannot choose its data and nobody has to hand
leases out; changing the window reshuffles every trainer's data.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from p2ptrain.core.manifests import DatasetManifest, ExperimentManifest
from p2ptrain.core.reasons import Code, Reason
from p2ptrain.core.records import Update
from p2ptrain.errors import LocalError

__all__ = ["Lease", "LeaseBook", "check_lease", "lease_for", "lease_runs", "lease_start"]

_DOMAIN = b"p2ptrain/v2/lease"
_START_DOMAIN = b"p2ptrain/v2/lease-start"


@dataclass(frozen=True, slots=True)
class Lease:
    """A trainer's data for one window: ``parts`` are (shard name, start, count) in
    rendezvous order, each the ``count`` samples of that shard from index ``start`` on,
    wrapping around its end; ``samples`` is their total."""

    window: int
    peer_id: str
    parts: tuple[tuple[str, int, int], ...]

    @property
    def samples(self) -> int:
        return sum(count for _, _, count in self.parts)

    @property
    def shards(self) -> tuple[str, ...]:
        """The shard names, sorted (as an :class:`Update` lists them)."""
        return tuple(sorted(name for name, _, _ in self.parts))


def _prefix(domain: bytes, experiment_id: str, window: int) -> hashlib._Hash:
    """SHA-256 fed ``domain 0 experiment 0 window 0``, to be copied for each shard."""
    return hashlib.sha256(b"\0".join([domain, experiment_id.encode(), str(window).encode(), b""]))


def lease_start(experiment_id: str, window: int, shard: str, peer_id: str, samples: int) -> int:
    """Where trainer ``peer_id``'s part of a shard of ``samples`` samples starts in
    ``window`` when it takes only some of them (see the module docstring)."""
    digest = _prefix(_START_DOMAIN, experiment_id, window)
    digest.update(shard.encode() + b"\0" + peer_id.encode())
    return int.from_bytes(digest.digest(), "big") % samples


def lease_for(
    manifest: ExperimentManifest, window: int, peer_id: str, *, experiment_id: str | None = None
) -> Lease:
    """The lease of trainer ``peer_id`` in ``window`` (pass ``experiment_id`` when it is
    already known, to skip re-hashing the manifest)."""
    experiment = manifest.id if experiment_id is None else experiment_id
    prefix = _prefix(_DOMAIN, experiment, window)
    suffix = b"\0" + peer_id.encode()

    def score(name: str) -> bytes:
        digest = prefix.copy()
        digest.update(name.encode() + suffix)
        return digest.digest()

    ranked = sorted(manifest.dataset.shards, key=lambda shard: score(shard.name))
    parts: list[tuple[str, int, int]] = []
    needed = manifest.lease_size
    for shard in ranked:
        if needed <= 0:
            break
        take = min(needed, shard.samples)
        start = 0
        if take < shard.samples:
            start = lease_start(experiment, window, shard.name, peer_id, shard.samples)
        parts.append((shard.name, start, take))
        needed -= take
    return Lease(window=window, peer_id=peer_id, parts=tuple(parts))


def lease_runs(dataset: DatasetManifest, lease: Lease) -> list[tuple[int, int]]:
    """The dataset indices a lease names, as half-open runs ``[a, b)`` in lease order: a part
    ``(shard, start, count)`` takes the shard's indices ``start, start + 1, ...`` (``count``
    of them, wrapping around to the shard's first index after its last: two runs); shards
    start at the cumulative sample counts of the shards before them in manifest order."""
    starts: dict[str, tuple[int, int]] = {}
    offset = 0
    for shard in dataset.shards:
        starts[shard.name] = (offset, shard.samples)
        offset += shard.samples
    runs: list[tuple[int, int]] = []
    for shard_name, start, count in lease.parts:
        found = starts.get(shard_name)
        if found is None:
            raise LocalError(
                f"the lease names shard {shard_name!r:.80}, which dataset {dataset.name!r} does "
                "not have: the lease was computed for another experiment's dataset; recompute it "
                "with lease_for() on this experiment's manifest"
            )
        first, samples = found
        if not 0 <= count <= samples:
            raise LocalError(
                f"the lease takes {count} samples of shard {shard_name!r}, which holds "
                f"{samples}; recompute the lease with lease_for() on this experiment's manifest"
            )
        if not 0 <= start < samples:
            raise LocalError(
                f"the lease starts at sample {start} of shard {shard_name!r}, which holds "
                f"{samples} (0 to {samples - 1}); recompute the lease with lease_for() on this "
                "experiment's manifest"
            )
        head = min(count, samples - start)
        runs.append((first + start, first + start + head))
        if count > head:
            runs.append((first, first + count - head))
    return runs


def check_lease(
    manifest: ExperimentManifest, update: Update, lease: Lease | None = None
) -> Reason | None:
    """Why ``update`` does not claim exactly the lease its trainer has in its window (None:
    it does)."""
    expected = lease if lease is not None else lease_for(manifest, update.window, update.trainer_id)
    if update.lease_shards != expected.shards:
        return Reason(Code.LEASE_SHARDS, (update.window,))
    if update.lease_samples != expected.samples:
        return Reason(Code.LEASE_SAMPLES, (update.lease_samples, expected.samples))
    return None


class LeaseBook:
    """Leases of one experiment, computed once per (window, trainer) and remembered for the
    most recent windows (a validator checks every trainer's lease each window)."""

    def __init__(self, manifest: ExperimentManifest, *, keep_windows: int = 4) -> None:
        if keep_windows < 1:
            raise LocalError(f"keep_windows must be at least 1, got {keep_windows}")
        self.manifest = manifest
        self.experiment_id = manifest.id
        self._keep = keep_windows
        self._leases: dict[int, dict[str, Lease]] = {}

    def lease(self, window: int, peer_id: str) -> Lease:
        per_window = self._leases.get(window)
        if per_window is None:
            per_window = self._leases[window] = {}
            for old in sorted(self._leases)[: -self._keep]:
                del self._leases[old]
        lease = per_window.get(peer_id)
        if lease is None:
            lease = lease_for(self.manifest, window, peer_id, experiment_id=self.experiment_id)
            per_window[peer_id] = lease
        return lease

    def check(self, update: Update) -> Reason | None:
        return check_lease(self.manifest, update, self.lease(update.window, update.trainer_id))
