"""What aggregation rules take and give: a cohort of updates in, an aggregate and a verdict
per update out. Failures are inputs, not exceptions (Flower's ``Strategy`` style): an update
that could not be fetched, decoded or screened enters as a :class:`Failure` and leaves as a
diagnostic, and a cohort too small for a rule yields a result with no aggregate and a reason.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from p2ptrain.errors import LocalError

#: Per-update outcomes a rule may report.
SELECTED = "selected"  # entered the aggregate unchanged
CLIPPED = "clipped"  # entered the aggregate scaled down
TRIMMED = "trimmed"  # some of its coordinates were dropped (trimmed mean, median)
EXCLUDED = "excluded"  # left out of the aggregate by the rule (e.g. not chosen by Krum)
FAILED = "failed"  # never reached the rule (fetch, decode or screening failure)


class FlatVector(Protocol):
    """A flat float32 vector that rules read span by span: a tensor, or an update blob
    decoded a span at a time (:class:`~p2ptrain.aggregate.update_reader.UpdateVector`,
    whose spans are valid until its next read)."""

    @property
    def dtype(self) -> torch.dtype: ...

    def numel(self) -> int: ...

    def dim(self) -> int: ...

    def __getitem__(self, index: slice, /) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Contribution:
    """One update entering aggregation: its id, its pseudo-gradient as one flat float32
    vector (see :func:`p2ptrain.aggregate.exact.flatten`) and its weight (lease samples)."""

    update_id: str
    vector: FlatVector
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.vector.dtype != torch.float32 or self.vector.dim() != 1:
            raise LocalError("a contribution's vector must be a 1-D float32 tensor")
        if not self.weight > 0:
            raise LocalError(f"a contribution's weight must be positive, got {self.weight}")


@dataclass(frozen=True, slots=True)
class Failure:
    """An update that never reached the rule, and why."""

    update_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class UpdateDiagnostics:
    """What the rule did with one update. ``distance`` is the float64 L2 distance from the
    update to the aggregate (None when there is no aggregate or the update failed)."""

    update_id: str
    status: str
    distance: float | None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class AggregationResult:
    """The aggregate (None when the rule could not produce one), a diagnostic per update in
    update-id order, and the reason for the outcome."""

    aggregate: torch.Tensor | None
    diagnostics: tuple[UpdateDiagnostics, ...]
    reason: str

    @property
    def ok(self) -> bool:
        return self.aggregate is not None


class AggregationRule(Protocol):
    """A robust aggregation rule. Implementations are pure and bit-exact: the result depends
    only on the set of contributions (they are sorted by update id inside)."""

    name: str

    def aggregate(
        self, contributions: Sequence[Contribution], failures: Sequence[Failure] = ()
    ) -> AggregationResult: ...


def in_canonical_order(contributions: Sequence[Contribution]) -> list[Contribution]:
    """Contributions sorted by update id; a repeated id is our misuse."""
    ordered = sorted(contributions, key=lambda c: c.update_id)
    for earlier, later in itertools.pairwise(ordered):
        if earlier.update_id == later.update_id:
            raise LocalError(f"update {earlier.update_id[:16]} appears twice in one cohort")
    lengths = {c.vector.numel() for c in ordered}
    if len(lengths) > 1:
        raise LocalError(f"contributions differ in length: {sorted(lengths)}")
    return ordered
