"""What a chaos run found, and the summary over runs (pure: data in, data out).

After a run every node is stopped and its data directory read back as a :class:`Replica`
(:mod:`.chaos_stores`). The verdicts:

* a **corrupt store** is a data directory that does not open or whose chain does not verify;
* a **lost certified head** is a head some node said it adopted (its ``adopted`` event comes
  after the head is stored) that no node's chain holds at the end, a node whose store ends
  below the highest head it said it adopted, or a restarted node that came back lower than it
  had been (both found by the runner, which saw the events);
* a **diverged replica** is a node whose chain holds, at some height, another head than most
  nodes holding that height, or whose tip weights hash differs from the others' at the same
  tip;
* a **stall** is a fault after whose heal no head was certified for longer than the stall
  limit (two window deadlines, at least 10 s); for a long outage or a late joiner also a
  network that stopped certifying while the fault waited for its heights, or a node that did
  not reach the network's height (as it was when the node was ready) within the catch-up
  bound;
* a **crashed node** is one that exited without being told to (a role that kept failing).

A fault's ``recovery_s`` runs from its heal to the next head certified anywhere, and its
``rejoin_s`` until every victim adopted a head at least as high as the network's at the heal
(reported, not judged, for the short faults; ``catch_up_seconds`` for the long ones, whose
``behind`` says how many heights the node had to catch up). A run fails on any verdict
above, or when it could not play its faults (``error``: a node did not start, no first
head); its seed then goes to ``failing_seeds``, and ``--runs 1 --seed SEED`` plays the same
faults again.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.bench.chaos_plan import ALL_KINDS, LONG_KINDS

__all__ = [
    "FaultOutcome",
    "Replica",
    "RunOutcome",
    "diverged_replicas",
    "lost_heads",
    "percentile",
    "summarize",
    "summary_lines",
]


@dataclass(frozen=True)
class FaultOutcome:
    kind: str
    victims: tuple[str, ...]
    #: The planned hold; an outage's: seconds from the kill until the victim was ready again.
    hold_s: float
    #: Seconds from the heal to the next head certified network-wide (None: none came).
    recovery_s: float | None
    #: No head was certified within the stall limit after the heal.
    stalled: bool
    #: Seconds from the heal until every victim adopted a head at least as high as the
    #: network's at the heal (None: one did not before the next fault or the end).
    rejoin_s: float | None = None
    note: str = ""
    #: A long outage's or a joiner's: the heights between the node's, when it was ready, and
    #: the network's (None: another kind).
    behind: int | None = None

    @property
    def long(self) -> bool:
        return self.kind in LONG_KINDS

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "victims": list(self.victims),
            "hold_s": self.hold_s,
            "recovery_s": self.recovery_s,
            "stalled": self.stalled,
            "rejoin_s": self.rejoin_s,
            "behind": self.behind,
            "note": self.note,
        }


@dataclass(frozen=True)
class Replica:
    """What one stopped node's data directory holds."""

    name: str
    #: Certified head id by height (genesis excluded).
    heads: Mapping[int, str]
    #: SHA-256 of the tip's weights as stored (None: the node does not hold them).
    weights_hash: str | None
    #: Why the store does not open or verify (None: it does).
    problem: str | None = None

    @property
    def tip_height(self) -> int:
        return max(self.heads, default=0)


@dataclass(frozen=True)
class RunOutcome:
    seed: int
    wall_s: float
    faults: tuple[FaultOutcome, ...]
    corrupt_stores: tuple[str, ...] = ()
    lost_heads: tuple[str, ...] = ()
    diverged: tuple[str, ...] = ()
    #: Nodes that exited by themselves, and how.
    crashed: tuple[str, ...] = ()
    #: Each node's stored tip height at the end.
    heights: Mapping[str, int] = field(default_factory=dict)
    #: Why the run could not play its faults (the network never certified, ...).
    error: str | None = None
    #: What the nodes said when a fault did not heal in time (status and log tails).
    diagnoses: tuple[str, ...] = ()
    #: Peers the nodes reported (struck) during the run: "node: peer reason".
    peer_reports: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: Strikes the nodes logged, by reason (transport faults included), and bans.
    strikes: Mapping[str, int] = field(default_factory=dict)
    bans: int = 0
    #: Where the run's data directories and logs were kept (failing runs).
    kept: str | None = None

    @property
    def stalled(self) -> bool:
        return any(f.stalled for f in self.faults)

    @property
    def failed(self) -> bool:
        return bool(
            self.corrupt_stores
            or self.lost_heads
            or self.diverged
            or self.crashed
            or self.stalled
            or self.error
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "failed": self.failed,
            "wall_s": round(self.wall_s, 1),
            "faults": [f.to_json() for f in self.faults],
            "corrupt_stores": list(self.corrupt_stores),
            "lost_heads": list(self.lost_heads),
            "diverged": list(self.diverged),
            "crashed": list(self.crashed),
            "heights": dict(sorted(self.heights.items())),
            "error": self.error,
            "diagnoses": list(self.diagnoses),
            "peer_reports": list(self.peer_reports),
            "notes": list(self.notes),
            "strikes": dict(self.strikes),
            "bans": self.bans,
            "kept": self.kept,
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), interpolating linearly between the closest ranks
    (numpy's default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0-100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _majority(counts: Counter[str]) -> str:
    """The most common value; on a tie, the smallest (so the verdict does not depend on
    the order nodes were read in)."""
    return min(counts, key=lambda value: (-counts[value], value))


def diverged_replicas(replicas: Sequence[Replica]) -> list[str]:
    """The nodes whose chain or tip weights disagree with most others' (see the module
    docstring); stores that do not open are left to the corrupt-store verdict."""
    healthy = [r for r in replicas if r.problem is None]
    by_height: dict[int, Counter[str]] = defaultdict(Counter)
    for replica in healthy:
        for height, head in replica.heads.items():
            by_height[height][head] += 1
    majority = {height: _majority(counts) for height, counts in by_height.items()}
    diverged = {r.name for r in healthy if any(majority[h] != head for h, head in r.heads.items())}
    by_tip: dict[str, Counter[str]] = defaultdict(Counter)
    for replica in healthy:
        if replica.heads and replica.weights_hash is not None:
            by_tip[replica.heads[replica.tip_height]][replica.weights_hash] += 1
    for replica in healthy:
        if replica.heads and replica.weights_hash is not None:
            counts = by_tip[replica.heads[replica.tip_height]]
            if replica.weights_hash != _majority(counts):
                diverged.add(replica.name)
    return sorted(diverged)


def lost_heads(
    replicas: Sequence[Replica], adopted: Mapping[str, Collection[tuple[int, str]]]
) -> list[str]:
    """Heads the nodes said they adopted (``adopted``: node -> (height, head id)) that no
    healthy store holds, and nodes whose store ends below what they said they adopted."""
    chains = {r.name: r for r in replicas if r.problem is None}
    adopters: dict[tuple[int, str], list[str]] = defaultdict(list)
    for name, heads in adopted.items():
        for pair in heads:
            adopters[pair].append(name)
    found = []
    for (height, head), names in sorted(adopters.items()):
        if not any(chain.heads.get(height) == head for chain in chains.values()):
            found.append(
                f"head {head[:12]} at height {height}, adopted by {', '.join(sorted(names))}, "
                "is in no node's stored chain"
            )
    for name, heads in sorted(adopted.items()):
        highest = max((height for height, _ in heads), default=0)
        if name in chains and chains[name].tip_height < highest:
            found.append(
                f"{name} adopted height {highest} but its store ends at height "
                f"{chains[name].tip_height}"
            )
    return found


def summarize(
    outcomes: Sequence[RunOutcome], *, netns: bool, partitions_skipped: str | None
) -> dict[str, Any]:
    """The JSON summary of ``p2ptrain bench chaos`` (``details``: each run's outcome)."""
    recoveries = [f.recovery_s for run in outcomes for f in run.faults if f.recovery_s is not None]
    short = [f for run in outcomes for f in run.faults if not f.long]
    long = [f for run in outcomes for f in run.faults if f.long]
    rejoins = [f.rejoin_s for f in short if f.rejoin_s is not None]
    catch_ups = [f.rejoin_s for f in long if f.rejoin_s is not None]
    counts = Counter(f.kind for run in outcomes for f in run.faults)
    return {
        "runs": len(outcomes),
        "corrupt_stores": sum(len(run.corrupt_stores) for run in outcomes),
        "lost_certified_heads": sum(len(run.lost_heads) for run in outcomes),
        "diverged_replicas": sum(len(run.diverged) for run in outcomes),
        "stalled_runs": sum(1 for run in outcomes if run.stalled),
        "crashed_nodes": sum(len(run.crashed) for run in outcomes),
        "broken_runs": sum(1 for run in outcomes if run.error is not None),
        "unrecovered_faults": sum(
            1 for run in outcomes for f in run.faults if f.recovery_s is None
        ),
        "recovery_seconds_p50": _rounded(percentile(recoveries, 50)),
        "recovery_seconds_p99": _rounded(percentile(recoveries, 99)),
        "rejoin_seconds_p50": _rounded(percentile(rejoins, 50)),
        "rejoin_seconds_p99": _rounded(percentile(rejoins, 99)),
        "faults_not_rejoined": sum(1 for f in short if f.rejoin_s is None),
        "catch_up_seconds_p50": _rounded(percentile(catch_ups, 50)),
        "catch_up_seconds_max": max(catch_ups, default=None),
        "not_caught_up": sum(1 for f in long if f.rejoin_s is None),
        "caught_up_heights_max": max(
            (f.behind for f in long if f.rejoin_s is not None and f.behind is not None),
            default=None,
        ),
        "faults": {kind: counts.get(kind, 0) for kind in ALL_KINDS},
        "logged_strikes": sum(sum(run.strikes.values()) for run in outcomes),
        "logged_bans": sum(run.bans for run in outcomes),
        "failing_seeds": sorted(run.seed for run in outcomes if run.failed),
        "netns": netns,
        "partitions_skipped": partitions_skipped,
        "details": [run.to_json() for run in outcomes],
    }


_COUNTS = (
    "corrupt_stores",
    "lost_certified_heads",
    "diverged_replicas",
    "stalled_runs",
    "crashed_nodes",
    "broken_runs",
    "unrecovered_faults",
    "faults_not_rejoined",
    "not_caught_up",
    "logged_strikes",
    "logged_bans",
)


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """The summary for people (``p2ptrain bench chaos`` without ``--json``)."""
    namespaces = "on" if summary["netns"] else "off"
    lines = [f"chaos: {summary['runs']} run(s) from seed {summary['seed']}, "
             f"namespaces {namespaces}"]  # fmt: skip
    if summary["partitions_skipped"]:
        lines.append(f"partitions skipped: {summary['partitions_skipped']}")
    lines.append("faults: " + ", ".join(f"{k} {n}" for k, n in summary["faults"].items()))
    lines += [f"{key.replace('_', ' '):24s}{summary[key]}" for key in _COUNTS]
    lines.append(f"{'recovery after a heal':24s}p50 {summary['recovery_seconds_p50']} s, "
                 f"p99 {summary['recovery_seconds_p99']} s")  # fmt: skip
    lines.append(f"{'victims back':24s}p50 {summary['rejoin_seconds_p50']} s, "
                 f"p99 {summary['rejoin_seconds_p99']} s")  # fmt: skip
    lines.append(f"{'caught up (long faults)':24s}p50 {summary['catch_up_seconds_p50']} s, "
                 f"max {summary['catch_up_seconds_max']} s, "
                 f"up to {summary['caught_up_heights_max']} heights")  # fmt: skip
    failing = summary["failing_seeds"]
    if not failing:
        lines.append("failing seeds: none")
        return lines
    replay = f"p2ptrain bench chaos --runs 1 --seed {failing[0]} {summary.get('replay_flags', '')}"
    lines.append(f"failing seeds: {', '.join(map(str, failing))} (replay: {replay.strip()})")
    lines += [
        f"  seed {run['seed']}: data directories and logs in {run['kept']}"
        for run in summary["details"]
        if run["failed"] and run["kept"]
    ]
    return lines
