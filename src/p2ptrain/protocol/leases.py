"""Leases: which samples a trainer trains on in a window, computed rather than granted.

For a trainer ``p`` and window ``w`` every shard ``s`` of the experiment's dataset gets the
score ``SHA-256("p2ptrain/v1/lease" 0 experiment 0 w 0 s 0 p)`` (rendezvous hashing); the
trainer takes shards in ascending score order until it holds ``lease_size`` samples, the
first samples of each shard and only as many of the last shard as it needs. Anyone can
recompute a lease, so a trainer cannot choose its data and nobody has to hand leases out;
changing the window reshuffles every trainer's data.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from p2ptrain.core.certificate import Verdict
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Update
from p2ptrain.errors import LocalError

__all__ = ["Lease", "LeaseBook", "check_lease", "lease_for"]

_DOMAIN = b"p2ptrain/v1/lease"


@dataclass(frozen=True, slots=True)
class Lease:
    """A trainer's data for one window: ``parts`` are (shard name, samples taken from the
    start of that shard) in rendezvous order; ``samples`` is their total."""

    window: int
    peer_id: str
    parts: tuple[tuple[str, int], ...]

    @property
    def samples(self) -> int:
        return sum(count for _, count in self.parts)

    @property
    def shards(self) -> tuple[str, ...]:
        """The shard names, sorted (as an :class:`Update` lists them)."""
        return tuple(sorted(name for name, _ in self.parts))


def _score(experiment_id: str, window: int, shard: str, peer_id: str) -> bytes:
    message = b"\0".join(
        [_DOMAIN, experiment_id.encode(), str(window).encode(), shard.encode(), peer_id.encode()]
    )
    return hashlib.sha256(message).digest()


def lease_for(
    manifest: ExperimentManifest, window: int, peer_id: str, *, experiment_id: str | None = None
) -> Lease:
    """The lease of trainer ``peer_id`` in ``window`` (pass ``experiment_id`` when it is
    already known, to skip re-hashing the manifest)."""
    experiment = manifest.id if experiment_id is None else experiment_id
    shards = manifest.dataset.shards
    ranked = sorted(shards, key=lambda shard: _score(experiment, window, shard.name, peer_id))
    parts: list[tuple[str, int]] = []
    needed = manifest.lease_size
    for shard in ranked:
        if needed <= 0:
            break
        take = min(needed, shard.samples)
        parts.append((shard.name, take))
        needed -= take
    return Lease(window=window, peer_id=peer_id, parts=tuple(parts))


def check_lease(
    manifest: ExperimentManifest, update: Update, lease: Lease | None = None
) -> Verdict:
    """Whether ``update`` claims exactly the lease its trainer has in its window."""
    expected = lease if lease is not None else lease_for(manifest, update.window, update.trainer_id)
    if update.lease_shards != expected.shards:
        return Verdict(
            False,
            f"lease names shards {list(update.lease_shards)[:4]}, the trainer's lease for window "
            f"{update.window} is {list(expected.shards)[:4]}",
        )
    if update.lease_samples != expected.samples:
        return Verdict(
            False,
            f"lease claims {update.lease_samples} samples, the lease holds {expected.samples}",
        )
    return Verdict(True, "lease matches")


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

    def check(self, update: Update) -> Verdict:
        return check_lease(self.manifest, update, self.lease(update.window, update.trainer_id))
