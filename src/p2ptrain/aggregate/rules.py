"""Aggregation rules by name: the coordinate-wise rules and the registry of every rule.

``make_rule(manifest.aggregation)`` builds the rule an experiment manifest names, with the
settings of ``aggregation.config`` (an unknown or out-of-range key raises
:class:`~p2ptrain.errors.LocalError` naming it). The rules and their defaults:

* ``mean``: weighted mean, weights = lease samples; no settings.
* ``trimmed_mean``: coordinate-wise, unweighted; ``beta = 0.2`` (``floor(beta n)`` dropped
  per side).
* ``median``: coordinate-wise, unweighted; no settings.
* ``krum``: multi-Krum; ``f = floor((n - 3) / 2)`` (the most ``n`` tolerates), ``m = n - f``.
* ``centered_clip``: from the coordinate-wise median; ``tau`` = the median distance to it,
  ``iterations = 3``.
* ``geometric_median``: Weiszfeld from the coordinate-wise median; ``iterations = 4``,
  ``eps = 1e-6``, ``tolerance = 1e-5``.
* ``contributor_mean``: per coordinate, the mean over the updates that sent it, each update
  first clipped to the median norm; ``clip = 1`` (:mod:`.rules_sparse`, for sparse codecs).

Every rule takes the cohort in any order (it sorts by update id), returns one diagnostic
per update (failures included) and, when the cohort is too small, no aggregate and a reason.
Every rule can write its aggregate into a caller's buffer (``out=``), so a reducer reuses
one buffer from window to window instead of faulting in fresh memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import torch

from p2ptrain.aggregate.cohort import (
    SELECTED,
    TRIMMED,
    AggregationResult,
    Contribution,
    Failure,
)
from p2ptrain.aggregate.rules_basic import (
    Ranked,
    RuleBase,
    RuleVerdict,
    TrimmedSpans,
    Workspace,
    check_float_setting,
    prepare,
    result,
    stream_pass,
    weighted_pass,
)
from p2ptrain.aggregate.rules_robust import (
    CenteredClip,
    CenteredClipConfig,
    GeometricMedian,
    GeometricMedianConfig,
    Krum,
    KrumConfig,
)
from p2ptrain.aggregate.rules_sparse import ContributorMean, ContributorMeanConfig
from p2ptrain.core.manifests import AggregationSpec, ConfigValue
from p2ptrain.errors import LocalError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "CenteredClip",
    "CenteredClipConfig",
    "ContributorMean",
    "ContributorMeanConfig",
    "GeometricMedian",
    "GeometricMedianConfig",
    "Krum",
    "KrumConfig",
    "Mean",
    "MeanConfig",
    "Median",
    "MedianConfig",
    "RankedRule",
    "StreamingRule",
    "TrimmedMean",
    "TrimmedMeanConfig",
    "make_rule",
    "rule_names",
]


class StreamingRule(Protocol):
    """An :class:`~p2ptrain.aggregate.cohort.AggregationRule` that can also write its
    aggregate into ``out`` (a contiguous float32 vector as long as the contributions)."""

    name: str

    def aggregate(
        self,
        contributions: Sequence[Contribution],
        failures: Sequence[Failure] = (),
        *,
        out: torch.Tensor | None = None,
    ) -> AggregationResult: ...


@runtime_checkable
class RankedRule(Protocol):
    """A rule that is a coordinate-wise trimmed mean, so that screening's first pass can
    take it ahead (:class:`~p2ptrain.aggregate.rules_basic.Ranked`)."""

    def trim_for(self, n: int) -> int:
        """Values dropped per side from a cohort of ``n`` contributions."""
        ...

    def from_ranked(
        self, contributions: Sequence[Contribution], failures: Sequence[Failure], ranked: Ranked
    ) -> AggregationResult | None:
        """What :meth:`aggregate` returns for this cohort, from ``ranked``; None when
        ``ranked`` is not this cohort's mean (other updates, another trim)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class MeanConfig:
    """The weighted mean takes no settings."""


@dataclasses.dataclass(frozen=True, slots=True)
class TrimmedMeanConfig:
    """``beta`` (default 0.3): the fraction trimmed from each side, ``0 <= beta < 0.5``;
    ``floor(beta * n)`` values are dropped per side (with the default: none below 4
    updates, one for 4 to 6, two for 7 to 9, three for 10 to 13, ...). The default is sized
    to tolerate 30% Byzantine trainers; ``p2ptrain bench byzantine`` measures it."""

    beta: float = 0.3

    def __post_init__(self) -> None:
        check_float_setting("beta", self.beta, 0.0, 0.5)


@dataclasses.dataclass(frozen=True, slots=True)
class MedianConfig:
    """The coordinate-wise median takes no settings."""


class Mean(RuleBase[MeanConfig], config=MeanConfig):
    """Weighted mean ``sum_i (w_i / W) u_i``: coefficients in float64, rounded to float32,
    then multiplied and added in update-id order (:class:`WeightedSpans`)."""

    name = "mean"

    empty_reason = "mean: no contributions to aggregate"

    def _aggregate(
        self, ordered: list[Contribution], failures: Sequence[Failure], out: torch.Tensor | None
    ) -> AggregationResult:
        coefficients, aggregate, squares = weighted_pass(
            [c.vector for c in ordered],
            range(len(ordered)),
            [c.weight for c in ordered],
            self._workspace,
            out=out,
        )
        verdicts = [RuleVerdict(SELECTED, f"weight share {c:.6g}") for c in coefficients]
        reason = f"mean: weighted mean of {len(ordered)} updates"
        return result(
            ordered,
            failures,
            aggregate=aggregate,
            squares=squares,
            verdicts=verdicts,
            reason=reason,
        )


def _trimmed(
    ordered: Sequence[Contribution],
    failures: Sequence[Failure],
    trim: int,
    *,
    reason: str,
    workspace: Workspace,
    out: torch.Tensor | None,
) -> AggregationResult:
    """Trimmed mean (or median) of the contributions, with per-update drop fractions."""
    combiner = TrimmedSpans(len(ordered), trim, workspace)
    vectors = [c.vector for c in ordered]
    aggregate, squares = stream_pass(vectors, combiner, workspace, out=out)
    return _trimmed_result(
        ordered, failures, aggregate, squares, combiner.dropped.tolist(), reason=reason
    )


def _trimmed_result(
    ordered: Sequence[Contribution],
    failures: Sequence[Failure],
    aggregate: torch.Tensor,
    squares: Sequence[float],
    dropped: Sequence[int],
    *,
    reason: str,
) -> AggregationResult:
    length = max(1, aggregate.numel())
    verdicts = [
        RuleVerdict(TRIMMED, f"dropped {count / length:.6g} of coordinates ({count})")
        for count in dropped
    ]
    return result(
        ordered, failures, aggregate=aggregate, squares=squares, verdicts=verdicts, reason=reason
    )


class _RankedBase:
    """:class:`RankedRule`'s :meth:`from_ranked` for the trimmed rules."""

    def trim_for(self, n: int) -> int:
        raise NotImplementedError

    def _reason(self, n: int, trim: int) -> str:
        raise NotImplementedError

    def from_ranked(
        self, contributions: Sequence[Contribution], failures: Sequence[Failure], ranked: Ranked
    ) -> AggregationResult | None:
        ordered = prepare(contributions, failures, None)
        trim = self.trim_for(len(ordered))
        if not ordered or tuple(c.update_id for c in ordered) != ranked.update_ids:
            return None
        if ranked.trim != trim:
            return None
        reason = self._reason(len(ordered), trim)
        return _trimmed_result(
            ordered, failures, ranked.aggregate, ranked.squares, ranked.dropped, reason=reason
        )


class TrimmedMean(_RankedBase, RuleBase[TrimmedMeanConfig], config=TrimmedMeanConfig):
    """Coordinate-wise trimmed mean: per coordinate, sort, drop ``floor(beta n)`` values
    from each side, add the rest in ascending order and divide by their count. Unweighted:
    every update carries the same weight by protocol design (the manifest fixes the lease
    size), so weights are ignored."""

    name = "trimmed_mean"

    empty_reason = "trimmed_mean: no contributions"

    def trim_for(self, n: int) -> int:
        return math.floor(self.config.beta * n)

    def _reason(self, n: int, trim: int) -> str:
        return f"trimmed_mean: dropped {trim} of {n} values per side (beta {self.config.beta})"

    def _aggregate(
        self, ordered: list[Contribution], failures: Sequence[Failure], out: torch.Tensor | None
    ) -> AggregationResult:
        n = len(ordered)
        trim = self.trim_for(n)
        reason = self._reason(n, trim)
        return _trimmed(ordered, failures, trim, reason=reason, workspace=self._workspace, out=out)


class Median(_RankedBase, RuleBase[MedianConfig], config=MedianConfig):
    """Coordinate-wise median, unweighted (see :class:`TrimmedMean`); for an even count,
    the midpoint ``(a + b) * 0.5`` of the two middle values."""

    name = "median"

    empty_reason = "median: no contributions"

    def _aggregate(
        self, ordered: list[Contribution], failures: Sequence[Failure], out: torch.Tensor | None
    ) -> AggregationResult:
        trim = self.trim_for(len(ordered))
        reason = self._reason(len(ordered), trim)
        return _trimmed(ordered, failures, trim, reason=reason, workspace=self._workspace, out=out)

    def trim_for(self, n: int) -> int:
        return (n - 1) // 2

    def _reason(self, n: int, trim: int) -> str:
        return f"median: coordinate-wise median of {n} updates"


# --- the registry -------------------------------------------------------------------------

Settings = Mapping[str, ConfigValue]
C = TypeVar("C", bound="DataclassInstance")


def _config(rule: str, config_type: type[C], settings: Settings) -> C:
    """``config_type`` built from a manifest's ``aggregation.config``; LocalError names an
    unknown key and lists the known ones."""
    known = sorted(field.name for field in dataclasses.fields(config_type))
    for key in sorted(settings):
        if key not in known:
            offer = f"its settings are: {', '.join(known)}" if known else "it takes none"
            raise LocalError(
                f"aggregation.config.{key} is not a setting of the {rule!r} rule ({offer}); "
                "remove it from the manifest"
            )
    return config_type(**settings)


_FACTORIES: dict[str, Callable[[Settings], StreamingRule]] = {
    "mean": lambda s: Mean(_config("mean", MeanConfig, s)),
    "trimmed_mean": lambda s: TrimmedMean(_config("trimmed_mean", TrimmedMeanConfig, s)),
    "median": lambda s: Median(_config("median", MedianConfig, s)),
    "krum": lambda s: Krum(_config("krum", KrumConfig, s)),
    "centered_clip": lambda s: CenteredClip(_config("centered_clip", CenteredClipConfig, s)),
    "geometric_median": lambda s: GeometricMedian(
        _config("geometric_median", GeometricMedianConfig, s)
    ),
    "contributor_mean": lambda s: ContributorMean(
        _config("contributor_mean", ContributorMeanConfig, s)
    ),
}


def rule_names() -> tuple[str, ...]:
    """Every registered rule, in registry order."""
    return tuple(_FACTORIES)


def make_rule(spec: AggregationSpec) -> StreamingRule:
    """The rule ``spec`` names, configured from ``spec.config``."""
    factory = _FACTORIES.get(spec.rule)
    if factory is None:
        raise LocalError(
            f"aggregation.rule {spec.rule!r} is not implemented; use one of: "
            + ", ".join(_FACTORIES)
        )
    return factory(spec.config)
