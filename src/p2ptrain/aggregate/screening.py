"""Screening updates from their tensors (DESIGN §4 step 4), before any rule sees them.

An update passes when its tensors have the model's schema (names, shapes, float32), are all
finite, its L2 norm lies within ``max_norm_ratio`` of the cohort median (above or below: a
trainer that sends near-zero updates has not trained), and its cosine to the cohort's robust
centre (the coordinate-wise median of the updates that passed the norm test) is at least
``min_cosine``. Every number behind a decision is a bit-exact float64 reduction, so every
validator reaches the same verdicts. Signatures, leases, base heads, replays and quarantine
are checked by the protocol layer, not here.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from p2ptrain.aggregate.cohort import Contribution, Failure
from p2ptrain.aggregate.exact import all_finite, dot64, flatten, norm64
from p2ptrain.aggregate.rules import make_rule
from p2ptrain.core.manifests import AggregationSpec, ScreeningSpec
from p2ptrain.core.reasons import Code, Reason, describe
from p2ptrain.core.tensors import TensorSpec


@dataclass(frozen=True, slots=True)
class Candidate:
    """A decoded update waiting for its verdict."""

    update_id: str
    tensors: Mapping[str, torch.Tensor]
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Checked:
    """A decoded update already flattened (:func:`~.exact.flatten`, sorted-name order) after
    :func:`check_structure` passed its tensors: a reducer keeps one float32 vector per
    update, not its tensors and their flat copy too."""

    update_id: str
    vector: torch.Tensor
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class ScreeningVerdict:
    """Whether one update passed screening, why, and the figures behind it."""

    update_id: str
    accepted: bool
    #: Why it was turned down (None: accepted).
    reason: Reason | None
    norm: float | None = None
    norm_ratio: float | None = None
    cosine: float | None = None


@dataclass(frozen=True, slots=True)
class ScreeningOutcome:
    """Verdicts in update-id order, and the cohort split for an aggregation rule."""

    verdicts: tuple[ScreeningVerdict, ...]
    contributions: tuple[Contribution, ...]
    failures: tuple[Failure, ...]


def check_structure(
    tensors: Mapping[str, torch.Tensor], schema: Sequence[TensorSpec]
) -> Reason | None:
    """None when ``tensors`` match ``schema`` and are finite float32, else the problem."""
    expected = {spec.name: spec for spec in schema}
    if set(tensors) != set(expected):
        return Reason(Code.SCHEMA_MISMATCH)
    for name in sorted(expected):
        tensor, spec = tensors[name], expected[name]
        if tensor.dtype != torch.float32:
            return Reason(Code.NOT_FLOAT32, (name[:64],))
        if tuple(tensor.shape) != tuple(spec.shape):
            return Reason(Code.WRONG_SHAPE, (name[:64],))
        if not all_finite(tensor):
            return Reason(Code.NOT_FINITE, (name[:64],))
    return None


def screen_cohort(
    candidates: Sequence[Candidate | Checked], schema: Sequence[TensorSpec], spec: ScreeningSpec
) -> ScreeningOutcome:
    """Screen a window's updates; the outcome does not depend on the order of ``candidates``
    (a :class:`Checked` one gives the verdict its tensors would)."""
    ordered = sorted(candidates, key=lambda c: c.update_id)
    verdicts: dict[str, ScreeningVerdict] = {}
    vectors: dict[str, torch.Tensor] = {}
    for candidate in ordered:
        if isinstance(candidate, Checked):
            vectors[candidate.update_id] = candidate.vector
            continue
        problem = check_structure(candidate.tensors, schema)
        if problem is not None:
            verdicts[candidate.update_id] = ScreeningVerdict(candidate.update_id, False, problem)
        else:
            vectors[candidate.update_id] = flatten(candidate.tensors)
    norms = {update_id: norm64(vector) for update_id, vector in vectors.items()}
    median_norm = statistics.median(norms.values()) if norms else 0.0
    in_range = _norm_screen(norms, median_norm, spec.max_norm_ratio, verdicts)
    centre = _robust_centre([vectors[i] for i in in_range])
    centre_norm = norm64(centre) if centre is not None else 0.0
    for update_id in in_range:
        ratio = norms[update_id] / median_norm if median_norm > 0 else 1.0
        if centre is None or centre_norm == 0.0 or norms[update_id] == 0.0:
            verdicts[update_id] = ScreeningVerdict(update_id, True, None, norms[update_id], ratio)
            continue
        cosine = dot64(vectors[update_id], centre) / (norms[update_id] * centre_norm)
        accepted = cosine >= spec.min_cosine
        reason = None if accepted else Reason(Code.COSINE_BELOW, (cosine, float(spec.min_cosine)))
        verdicts[update_id] = ScreeningVerdict(
            update_id, accepted, reason, norms[update_id], ratio, cosine
        )
    weights = {c.update_id: c.weight for c in ordered}
    final = tuple(verdicts[c.update_id] for c in ordered)
    return ScreeningOutcome(
        verdicts=final,
        contributions=tuple(
            Contribution(v.update_id, vectors[v.update_id], weights[v.update_id])
            for v in final
            if v.accepted
        ),
        failures=tuple(
            Failure(v.update_id, describe(v.reason)) for v in final if v.reason is not None
        ),
    )


def _norm_screen(
    norms: dict[str, float], median: float, max_ratio: float, verdicts: dict[str, ScreeningVerdict]
) -> list[str]:
    """Ids whose norm is within ``max_ratio`` of ``median``, in id order; the rest get a
    rejecting verdict."""
    passed: list[str] = []
    for update_id in sorted(norms):
        norm = norms[update_id]
        ratio = norm / median if median > 0 else 1.0
        if median > 0 and ratio > max_ratio:
            reason = Reason(Code.NORM_ABOVE, (ratio, float(max_ratio)))
        elif median > 0 and ratio < 1.0 / max_ratio:
            reason = Reason(Code.NORM_BELOW, (ratio, float(max_ratio)))
        else:
            passed.append(update_id)
            continue
        verdicts[update_id] = ScreeningVerdict(update_id, False, reason, norm, ratio)
    return passed


def _robust_centre(vectors: list[torch.Tensor]) -> torch.Tensor | None:
    """Coordinate-wise median of ``vectors`` (bit-exact), or None for an empty cohort."""
    if not vectors:
        return None
    contributions = [Contribution(f"{i:08d}", vector) for i, vector in enumerate(vectors)]
    return make_rule(AggregationSpec(rule="median")).aggregate(contributions).aggregate
