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
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "KINDS",
    "MAX_FAULTS",
    "NODES",
    "REFERENCE_BUDGET_S",
    "Fault",
    "plan_faults",
    "planned_seconds",
]

KINDS = ("kill", "pause", "partition")
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
MAX_FAULTS = 5
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
    #: The nodes killed, paused or cut off, in :data:`NODES` order.
    victims: tuple[str, ...]
    after_s: float
    hold_s: float

    def describe(self) -> str:
        return f"{self.kind} {'+'.join(self.victims)} for {self.hold_s:.1f} s"


def plan_faults(
    seed: int,
    *,
    kinds: Sequence[str],
    budget_s: float = REFERENCE_BUDGET_S,
    nodes: Sequence[str] = NODES,
) -> tuple[Fault, ...]:
    """The faults of the run whose seed is ``seed`` (see the module docstring)."""
    unknown = sorted(set(kinds) - set(KINDS))
    if not kinds or unknown:
        raise ValueError(f"kinds must be some of {KINDS}, got {list(kinds)}")
    if budget_s <= 0:
        raise ValueError(f"budget_s must be positive, got {budget_s}")
    if len(nodes) < 2:
        raise ValueError("a chaos run needs at least two nodes")
    rng = random.Random(seed)
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
    return tuple(faults)


def planned_seconds(faults: Sequence[Fault]) -> float:
    """The time the faults take, without the recoveries between them."""
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
