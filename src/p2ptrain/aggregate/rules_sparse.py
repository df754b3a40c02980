"""``contributor_mean``: the rule for sparse updates (SparseLoCo's aggregation).

A sparse update sends a few percent of the coordinates; dividing every coordinate by the
cohort's size would shrink each sent value by the share of updates that did not send that
coordinate. So each coordinate is averaged over the updates that sent it (whose decoded
value is not zero), and a coordinate nobody sent stays zero. Before that, each update is
clipped to the cohort's median L2 norm (``clip = 1``, the default), so that one update
cannot outweigh the others by its size.

Bit-exact like every rule: the norms are :func:`~.rules_basic.stream_pass`'s float64
distances to zero, the median is taken over them in float64 (for an even count the mean of
the two middle norms), each coefficient ``min(1, median / norm)`` is rounded to float32 once,
and per coordinate ``sum_i c_i * u_i`` (separate multiply and add, in update-id order) is
divided by the count of non-zero ``u_i`` (a small exact float32 integer, 1 when it is 0).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

import torch

from p2ptrain.aggregate.cohort import CLIPPED, SELECTED, AggregationResult, Contribution, Failure
from p2ptrain.aggregate.rules_basic import (
    SPAN,
    RuleBase,
    RuleVerdict,
    Workspace,
    check_int_setting,
    float32,
    result,
    stream_pass,
)

__all__ = ["ContributorMean", "ContributorMeanConfig"]


@dataclasses.dataclass(frozen=True, slots=True)
class ContributorMeanConfig:
    """``clip`` (default 1): scale each update down to the cohort's median L2 norm before
    averaging; 0 averages them as they are."""

    clip: int = 1

    def __post_init__(self) -> None:
        check_int_setting("clip", self.clip, 0, 1)


class _Zeros:
    """Writes zeros: a pass with it measures each update's squared norm."""

    def combine(
        self, start: int, rows: Sequence[torch.Tensor], out: torch.Tensor
    ) -> torch.Tensor | None:
        out.zero_()
        return None


class _ContributorSpans:
    """Per coordinate, ``sum_i c_i * rows[i]`` over the count of non-zero ``rows[i]``."""

    def __init__(self, coefficients: Sequence[float], workspace: Workspace) -> None:
        self.coefficients = [float32(c) for c in coefficients]
        self._scratch = workspace.get("contributor.scratch", SPAN, torch.float32)
        self._count = workspace.get("contributor.count", SPAN, torch.float32)

    def combine(
        self, start: int, rows: Sequence[torch.Tensor], out: torch.Tensor
    ) -> torch.Tensor | None:
        tmp, count = self._scratch[: out.numel()], self._count[: out.numel()]
        out.zero_()
        count.zero_()
        for row, c in zip(rows, self.coefficients, strict=True):
            torch.mul(row, c, out=tmp)
            torch.add(out, tmp, out=out)
            count.add_(row.ne(0))
        count.clamp_(min=1.0)
        torch.div(out, count, out=out)
        return None


class ContributorMean(RuleBase[ContributorMeanConfig], config=ContributorMeanConfig):
    """Per-coordinate mean over the updates that sent the coordinate, each update first
    clipped to the cohort's median norm (see the module docstring). Unweighted, like the
    trimmed mean: the manifest fixes every lease's size."""

    name = "contributor_mean"

    empty_reason = "contributor_mean: no contributions"

    def coefficients(
        self, ordered: Sequence[Contribution], out: torch.Tensor | None
    ) -> list[float]:
        """Each update's clipping coefficient, ``min(1, median norm / its norm)`` (all 1
        without clipping)."""
        if not self.config.clip:
            return [1.0] * len(ordered)
        _, squares = stream_pass([c.vector for c in ordered], _Zeros(), self._workspace, out=out)
        norms = [math.sqrt(square) for square in squares]
        median = statistics.median(norms)
        return [1.0 if norm <= median else median / norm for norm in norms]

    def _aggregate(
        self, ordered: list[Contribution], failures: Sequence[Failure], out: torch.Tensor | None
    ) -> AggregationResult:
        coefficients = self.coefficients(ordered, out)
        combiner = _ContributorSpans(coefficients, self._workspace)
        vectors = [c.vector for c in ordered]
        aggregate, squares = stream_pass(vectors, combiner, self._workspace, out=out)
        verdicts = [
            RuleVerdict(CLIPPED, f"scaled by {float32(c):.6g} to the median norm")
            if c < 1.0
            else RuleVerdict(SELECTED, "within the median norm")
            for c in coefficients
        ]
        clipped = sum(c < 1.0 for c in coefficients)
        reason = (
            f"contributor_mean: per-coordinate mean over the senders of {len(ordered)} updates"
            + (f", {clipped} clipped to the median norm" if self.config.clip else "")
        )
        return result(
            ordered,
            failures,
            aggregate=aggregate,
            squares=squares,
            verdicts=verdicts,
            reason=reason,
        )
