"""Coverage: how evenly the leases of some trainers over some windows reach a dataset.

Leases are recomputed (:func:`~p2ptrain.protocol.leases.lease_for`) and every sample of the
dataset gets the number of leases that hold it. :func:`lease_coverage` sums them up: the
fraction of samples leased at least once, and the most-leased sample's count over the mean
count (1.0 when every sample is leased equally often). Counting goes through one difference
array over the whole dataset, so 5000 leases over 70,000 samples take well under a second.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from p2ptrain.core.manifests import DatasetManifest, ExperimentManifest
from p2ptrain.errors import LocalError
from p2ptrain.protocol.leases import Lease, lease_for

__all__ = ["Coverage", "lease_counts", "lease_coverage", "summarise_counts"]


@dataclass(frozen=True, slots=True)
class Coverage:
    """What the leases of ``trainers`` trainers over ``windows`` windows reach."""

    trainers: int
    windows: int
    shards: int
    #: Samples in the dataset.
    samples: int
    lease_size: int
    leases: int
    #: Fraction of the dataset's samples leased at least once.
    coverage: float
    never_leased: int
    #: Leased samples (all leases together) per sample of the dataset: the mean count.
    mean_leases_per_sample: float
    #: How many leases hold the most-leased sample.
    max_leases: int
    #: ``max_leases / mean_leases_per_sample`` (0.0 when nothing is leased).
    max_over_mean: float


def lease_counts(dataset: DatasetManifest, leases: Iterable[Lease]) -> np.ndarray:
    """For each sample of ``dataset`` (in dataset index order), how many of ``leases`` hold
    it. A part names ``count`` samples from ``start`` on, wrapping around its shard's end."""
    where: dict[str, tuple[int, int]] = {}
    offset = 0
    for shard in dataset.shards:
        where[shard.name] = (offset, shard.samples)
        offset += shard.samples
    # Each run of consecutive indices [a, b) adds 1 at a and -1 at b; a part that wraps is
    # two runs. The running sum of the differences is the count.
    opens: list[int] = []
    closes: list[int] = []
    for lease in leases:
        for name, start, count in lease.parts:
            found = where.get(name)
            if found is None:
                raise LocalError(f"a lease names shard {name!r:.80}, which the dataset lacks")
            first, samples = found
            if not (0 <= start < samples and 0 <= count <= samples):
                raise LocalError(
                    f"a lease takes {count} samples from {start} of shard {name!r}, which "
                    f"holds {samples}"
                )
            head = min(count, samples - start)
            opens.append(first + start)
            closes.append(first + start + head)
            if count > head:
                opens.append(first)
                closes.append(first + count - head)
    differences = np.zeros(offset + 1, dtype=np.int64)
    np.add.at(differences, np.asarray(opens, dtype=np.int64), 1)
    np.add.at(differences, np.asarray(closes, dtype=np.int64), -1)
    counts: np.ndarray = np.cumsum(differences[:-1])
    return counts


def summarise_counts(
    counts: np.ndarray, *, trainers: int, windows: int, shards: int, lease_size: int
) -> Coverage:
    """The figures of :class:`Coverage` from per-sample lease counts."""
    samples = int(counts.size)
    total = int(counts.sum())
    mean = total / samples if samples else 0.0
    highest = int(counts.max()) if samples else 0
    never = int(np.count_nonzero(counts == 0))
    return Coverage(
        trainers=trainers,
        windows=windows,
        shards=shards,
        samples=samples,
        lease_size=lease_size,
        leases=trainers * windows,
        coverage=(samples - never) / samples if samples else 0.0,
        never_leased=never,
        mean_leases_per_sample=mean,
        max_leases=highest,
        max_over_mean=highest / mean if mean else 0.0,
    )


def lease_coverage(
    manifest: ExperimentManifest, peer_ids: Sequence[str], windows: Sequence[int]
) -> Coverage:
    """The coverage of the leases of trainers ``peer_ids`` in ``windows``."""
    experiment_id = manifest.id
    leases = (
        lease_for(manifest, window, peer_id, experiment_id=experiment_id)
        for window in windows
        for peer_id in peer_ids
    )
    counts = lease_counts(manifest.dataset, leases)
    return summarise_counts(
        counts,
        trainers=len(peer_ids),
        windows=len(windows),
        shards=len(manifest.dataset.shards),
        lease_size=manifest.lease_size,
    )
