"""The faults of one chaos run, drawn from the run's seed alone (pure: no clock, no I/O).

Run ``r`` of ``p2ptrain bench chaos --seed S`` has the seed ``S + r`` and its faults come
from ``random.Random(S + r)`` only, so ``--runs 1 --seed S+r`` plays the same faults again.

A plan holds one fault of every kind available -- ``kill`` and ``pause`` always,
``partition`` when the nodes run in network namespaces -- in random order, so every run has
at least two faults and every kind occurs in every run; then more faults of random kinds
while the planned time (quiet gaps plus holds) stays within the run's budget, up to
:data:`MAX_FAULTS`. The faults strike one after the other: each one ``after_s`` seconds
after the network certified again following the previous one (or after the first certified
head), and each lasts ``hold_s`` seconds:

* ``kill``: SIGKILL the victims, wait ``hold_s``, start them again on their data directories;
* ``pause``: SIGSTOP the victims for ``hold_s``, then SIGCONT (a long pause outlives the
  WebSocket heartbeat, so peers may drop the connection);
* ``partition``: cut the victims off from the other nodes for ``hold_s`` (the victims still
  reach each other), then heal.

A *long* run (:class:`LongFaults`: one whose seed is a multiple of ``every``) also plays the
two faults of a network that grew older than one catch-up page (256 links), at random places
among the others (the joiner after the outage), and its other faults get at most
:data:`LONG_RUN_BUDGET_S` of planned time, so that the run stays a few minutes long:

* ``outage``: SIGKILL one victim (a validator -- the other two keep the quorum -- or, when
  windows are short, a trainer: the other one keeps training), keep it down until the
  network certified more than ``heights`` heights, then start it again on its data directory;
  it must reach the network's tip;
* ``join``: once the chain is longer than ``heights``, start :data:`JOINER`, a viewer with an
  empty data directory; it must reach the network's tip.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ALL_KINDS",
    "JOINER",
    "KINDS",
    "LONG_KINDS",
    "LONG_RUN_BUDGET_S",
    "MAX_FAULTS",
    "NODES",
    "REFERENCE_BUDGET_S",
    "Fault",
    "LongFaults",
    "plan_faults",
    "planned_seconds",
]

#: The short faults, which every run plays.
KINDS = ("kill", "pause", "partition")
#: The faults of a long run (see the module docstring).
LONG_KINDS = ("outage", "join")
ALL_KINDS = KINDS + LONG_KINDS
#: The network of every run: a seed, a reducer, three validators (quorum 2), two trainers.
NODES = (
    "seed",
    "reducer-0",
    "validator-0",
    "validator-1",
    "validator-2",
    "trainer-0",
    "trainer-1",
)
#: The fresh node a long run starts late: a viewer with an empty data directory.
JOINER = "viewer-joiner"
#: Short faults per run at most (a long run adds its outage and its joiner).
MAX_FAULTS = 5
#: The planned time of a long run's short faults at most (their holds shrink to fit).
LONG_RUN_BUDGET_S = 15.0
#: The budget at which holds take their full ranges; a smaller budget shortens them.
REFERENCE_BUDGET_S = 60.0
#: Seconds each kind holds (at the reference budget): a paused node may outlive the 20 s
#: WebSocket heartbeat; a partition outlives a window deadline or two.
HOLD_S = {"kill": (1.0, 8.0), "pause": (3.0, 40.0), "partition": (5.0, 35.0)}
#: Quiet seconds before a fault: a random moment in the windows that follow a recovery.
AFTER_S = (0.5, 6.0)
#: How many nodes a partition cuts off (a kill or a pause takes one node, or two).
CUT_SIZES = (1, 2, 2, 3)
TWO_VICTIMS_CHANCE = 0.25


@dataclass(frozen=True)
class Fault:
    kind: str
    #: The nodes killed, paused or cut off (in :data:`NODES` order), or the joiner.
    victims: tuple[str, ...]
    after_s: float
    hold_s: float
    #: ``outage``: the victim stays down until the network certified more heights than
    #: this; ``join``: the joiner starts once the chain is longer than this.
    heights: int = 0

    def describe(self) -> str:
        who = "+".join(self.victims)
        if self.kind == "outage":
            return f"outage {who} for more than {self.heights} heights"
        if self.kind == "join":
            return f"join {who} after height {self.heights}"
        return f"{self.kind} {who} for {self.hold_s:.1f} s"


@dataclass(frozen=True)
class LongFaults:
    """Which runs play the long outage and the fresh joiner, and how long the outage is."""

    #: Runs whose seed is a multiple of this are long (1: every run; 0: none).
    every: int = 5
    #: The outage lasts, and the joiner waits for, more than this many heights (0: none).
    heights: int = 300
    #: Whom an outage may take (see the module docstring).
    victims: tuple[str, ...] = ("validator-0", "validator-1", "validator-2")

    def __post_init__(self) -> None:
        if self.every < 0 or self.heights < 0:
            raise ValueError(f"every and heights must be 0 or more, got {self}")
        if self.every and self.heights and not self.victims:
            raise ValueError("an outage needs at least one possible victim")

    def plays(self, seed: int) -> bool:
        """Whether the run whose seed is ``seed`` is long."""
        return self.every > 0 and self.heights > 0 and seed % self.every == 0


def plan_faults(
    seed: int,
    *,
    kinds: Sequence[str],
    budget_s: float = REFERENCE_BUDGET_S,
    nodes: Sequence[str] = NODES,
    long: LongFaults | None = None,
) -> tuple[Fault, ...]:
    """The faults of the run whose seed is ``seed`` (see the module docstring); ``long``:
    which runs are long (None: none)."""
    unknown = sorted(set(kinds) - set(KINDS))
    if not kinds or unknown:
        raise ValueError(f"kinds must be some of {KINDS}, got {list(kinds)}")
    if budget_s <= 0:
        raise ValueError(f"budget_s must be positive, got {budget_s}")
    if len(nodes) < 2:
        raise ValueError("a chaos run needs at least two nodes")
    rng = random.Random(seed)
    long_run = long if long is not None and long.plays(seed) else None
    if long_run is not None:
        budget_s = min(budget_s, LONG_RUN_BUDGET_S)
    scale = min(1.0, budget_s / REFERENCE_BUDGET_S)
    order = sorted(set(kinds), key=KINDS.index)
    rng.shuffle(order)
    while len(order) < 2:
        order.append(rng.choice(sorted(kinds)))
    faults = [_fault(rng, kind, nodes, scale) for kind in order]
    while len(faults) < MAX_FAULTS:
        extra = _fault(rng, rng.choice(sorted(set(kinds))), nodes, scale)
        if planned_seconds([*faults, extra]) > budget_s:
            break
        faults.append(extra)
    if long_run is not None:  # drawn last: a short run's faults stay as they were
        victim = rng.choice(long_run.victims)
        outage_at = rng.randint(0, len(faults))
        faults.insert(outage_at, _long_fault(rng, "outage", victim, long_run.heights))
        join_at = rng.randint(outage_at + 1, len(faults))
        faults.insert(join_at, _long_fault(rng, "join", JOINER, long_run.heights))
    return tuple(faults)


def planned_seconds(faults: Sequence[Fault]) -> float:
    """The time the faults take, without the recoveries between them (and without the
    heights that an outage or a joiner waits for)."""
    return sum(f.after_s + f.hold_s for f in faults)


def _fault(rng: random.Random, kind: str, nodes: Sequence[str], scale: float) -> Fault:
    if kind == "partition":
        count = rng.choice(CUT_SIZES)
    else:
        count = 2 if rng.random() < TWO_VICTIMS_CHANCE else 1
    chosen = set(rng.sample(list(nodes), min(count, len(nodes) - 1)))
    low, high = HOLD_S[kind]
    hold = rng.uniform(low, low + (high - low) * scale)
    after = rng.uniform(*AFTER_S)
    return Fault(
        kind=kind,
        victims=tuple(n for n in nodes if n in chosen),
        after_s=round(after, 2),
        hold_s=round(hold, 2),
    )


def _long_fault(rng: random.Random, kind: str, victim: str, heights: int) -> Fault:
    after = rng.uniform(*AFTER_S)
    return Fault(kind, (victim,), after_s=round(after, 2), hold_s=0.0, heights=heights)
