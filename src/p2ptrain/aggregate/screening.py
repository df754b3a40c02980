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

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2ptrain.aggregate import native
from p2ptrain.aggregate.cohort import Contribution, Failure, FlatVector
from p2ptrain.aggregate.exact import CHUNK, all_finite, flatten
from p2ptrain.aggregate.rules_basic import (
    NETWORK_MAX_UPDATES,
    WINDOW,
    RowSums,
    TrimmedSpans,
    Workspace,
    read_window,
    sorting_network,
    windows,
)
from p2ptrain.aggregate.update_reader import UpdateVector
from p2ptrain.core.manifests import ScreeningSpec
from p2ptrain.core.reasons import Code, Reason, describe
from p2ptrain.core.tensors import TensorSpec
from p2ptrain.errors import LocalError, ProtocolViolation


@dataclass(frozen=True, slots=True)
class Candidate:
    """A decoded update waiting for its verdict."""

    update_id: str
    tensors: Mapping[str, torch.Tensor]
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Checked:
    """An update already seen as one flat vector (sorted-name order) whose structure is
    known good: a flattened tensor after :func:`check_structure`, or an update read span by
    span (:class:`~.update_reader.UpdateVector`) with its ``norm`` from :func:`measure`."""

    update_id: str
    vector: FlatVector
    weight: float = 1.0
    #: Its L2 norm (exactly ``norm64``), when already measured.
    norm: float | None = None


@dataclass(frozen=True, slots=True)
class Centre:
    """The cohort's robust centre seen through its products with ``update_ids`` (in that
    order) and its own norm: what :func:`_centre_products` gives for exactly these updates,
    computed ahead (:func:`measure_with_centre`) on the bet that none is screened out on
    its norm."""

    update_ids: tuple[str, ...]
    dots: tuple[float, ...]
    norm: float


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


def measure(vectors: Sequence[FlatVector], workspace: Workspace | None = None) -> list[float | str]:
    """Read every value of every vector once (a window at a time): each vector's L2 norm
    (exactly ``norm64``), or why it cannot be used -- a read that raised
    :class:`ProtocolViolation` (bad bytes in an update blob), or values that are not
    finite. This is a reduction's first pass: afterwards, every span of a vector it passed
    reads without error."""
    if not vectors:
        return []
    n, length = len(vectors), vectors[0].numel()
    sums = RowSums(n, length, n, workspace or Workspace())
    problems: dict[int, str] = {}
    zeros = torch.zeros(min(length, max(sums.span, next(windows(length, sums.span))[1])))
    for first, last in windows(length, sums.span):
        spans: list[torch.Tensor | None] = []
        live = [None if i in problems else vector for i, vector in enumerate(vectors)]
        for i, read in enumerate(read_window(live, first, last)):
            if isinstance(read, ProtocolViolation):
                problems[i] = str(read)
            elif read is not None and not _finite(vectors[i], read):
                problems[i] = f"values {first}..{last} are not all finite"
            # a refused row counts as zeros from here on
            usable = isinstance(read, torch.Tensor) and i not in problems
            spans.append(read if usable and isinstance(read, torch.Tensor) else None)
        # squared distances from zero are the squares (x - 0 is x): the kernel's tree
        if sums.fill_natively(spans, None, zeros[: last - first], (first, last), base=first):
            continue
        for start in range(first, last, sums.span):
            end = min(start + sums.span, last)
            terms = sums.terms(start, end, n)
            for i, span in enumerate(spans):
                if span is None:
                    terms[i].zero_()
                else:
                    terms[i].copy_(span[start - first : end - first])
            terms.mul_(terms)
            sums.collect(start, end, 0, n)
    totals = sums.totals()
    return [problems[i] if i in problems else math.sqrt(totals[i]) for i in range(n)]


def _finite(vector: FlatVector, span: torch.Tensor) -> bool:
    """Whether ``span``, just read from ``vector``, holds finite values only (an update
    whose decoder checked them is not checked again)."""
    return (isinstance(vector, UpdateVector) and vector.checked_finite) or all_finite(span)


@dataclass(frozen=True, slots=True)
class FirstPass:
    """What :func:`measure_with_centre` found in one read of every value."""

    #: each vector's L2 norm (exactly :func:`measure`'s)
    norms: list[float]
    #: each vector's product with the centre of them all, and the centre's norm
    dots: tuple[float, ...]
    centre_norm: float
    #: with a ``trim``: the trimmed mean of them all, each one's squared distance to it and
    #: its count of dropped coordinates (``TrimmedSpans``' bits)
    mean: torch.Tensor | None = None
    distances: tuple[float, ...] = ()
    dropped: tuple[int, ...] = ()


#: Values per window of a first pass whose int8 updates the kernel decodes: a window's
#: centre (float32) and, for each update, its mapped codes (bytes) are held at a time.
CODES_WINDOW = 16 * CHUNK


def _int8_rows(vectors: Sequence[FlatVector]) -> native.Int8Rows | None:
    """The vectors as int8 codes for the kernel to decode, when every one is an int8
    update in memory (or a mapped file) with the same parameters."""
    found = []
    for vector in vectors:
        codes = vector.int8_codes() if isinstance(vector, UpdateVector) else None
        if codes is None:
            return None
        found.append(codes)
    first = found[0]
    if any((c.starts, c.block_size) != (first.starts, first.block_size) for c in found):
        return None
    return native.Int8Rows(
        first.starts,
        first.block_size,
        [c.q for c in found],
        [c.scale for c in found],
        torch.zeros(len(found), dtype=torch.int32),
    )


def measure_with_centre(vectors: Sequence[FlatVector], trim: int | None = None) -> FirstPass | None:
    """:func:`measure` and, in the same pass, the centre of all ``vectors`` (what
    :func:`_centre_products` gives for them: the dot products, the centre's norm): one read
    of every value instead of two when no update is turned down on its norm, as in an
    honest window. With ``trim``, the same sort also gives the trimmed mean of them all
    (``trim`` dropped per side), for a trimmed rule to take when screening accepts every
    one. None when the C kernel cannot take the pass or a read fails: then :func:`measure`
    tells what failed."""
    if not vectors:
        return None
    n, length = len(vectors), vectors[0].numel()
    if trim is not None and not 0 <= trim <= (n - 1) // 2:
        raise LocalError(f"a trimmed mean of {n} values cannot drop {trim} per side")
    if n > NETWORK_MAX_UPDATES or not native.available():
        return None
    workspace = Workspace()
    # the kernel's pass alone: each block's trees halved to one value there
    sums = RowSums(n + 1, length, n + 1, workspace, tail=1)
    squares = RowSums(n + 1, length, n + 1, workspace, key="row_sums.squares", tail=1)
    median = (n - 1) // 2
    # a network that decides the ranks of the trimmed mean decides the median's too
    low = median if trim is None else trim
    dropped = torch.zeros(n, dtype=torch.int64)
    kernel = native.Trimmed(n, median, sorting_network(n, low, n - 1 - low), dropped)
    distances: RowSums | None = None
    mean: torch.Tensor | None = None
    if trim is not None:
        distances = RowSums(n + 1, length, n + 1, workspace, key="row_sums.distances", tail=1)
        mean = torch.empty(length, dtype=torch.float32)
    # int8 updates seen whole in memory are decoded inside the kernel, a slice at a time,
    # in longer windows (nothing is decoded into them)
    codes = _int8_rows(vectors)
    size = WINDOW if codes is None else CODES_WINDOW
    width = min(length, max(sums.span, next(windows(length, sums.span, size))[1]))
    centre = torch.empty(width, dtype=torch.float32)
    for first, last in windows(length, sums.span, size):
        spans: list[torch.Tensor | None] = [None] * n
        if codes is None:
            spans = []
            for vector, read in zip(vectors, read_window(vectors, first, last), strict=True):
                if not isinstance(read, torch.Tensor) or not _finite(vector, read):
                    return None
                spans.append(read)
        window = centre[: last - first]
        second = None
        if trim is not None and mean is not None and distances is not None:
            second = (trim, mean[first:last], distances)
        # the centre itself is the last row: its product with itself is its squared norm
        if not sums.fill_natively(
            [*spans, window], kernel, window, (first, last), base=first, products=True,
            squares=squares, second=second, codes=codes,
        ):  # fmt: skip
            return None
        if codes is not None:
            for vector in vectors:
                if isinstance(vector, UpdateVector):
                    vector.forget(first, last)
    if codes is not None and bool(codes.status.any()):
        return None  # a bad code, scale or value: measure() names the update
    dots, norms = sums.totals(), squares.totals()
    ranked: dict[str, Any] = {}
    if mean is not None and distances is not None:
        ranked = {
            "mean": mean,
            "distances": tuple(distances.totals()[:n]),
            "dropped": tuple(dropped.tolist()),
        }
    return FirstPass(
        [math.sqrt(value) for value in norms[:n]], tuple(dots[:n]), math.sqrt(dots[n]), **ranked
    )


def screen_cohort(
    candidates: Sequence[Candidate | Checked],
    schema: Sequence[TensorSpec],
    spec: ScreeningSpec,
    centre: Centre | None = None,
) -> ScreeningOutcome:
    """Screen a window's updates; the outcome does not depend on the order of ``candidates``
    (a :class:`Checked` one gives the verdict its tensors would). ``centre``: the centre of
    some updates computed ahead, used when exactly those pass the norm test."""
    ordered = sorted(candidates, key=lambda c: c.update_id)
    verdicts: dict[str, ScreeningVerdict] = {}
    vectors: dict[str, FlatVector] = {}
    norms: dict[str, float] = {}
    for candidate in ordered:
        if isinstance(candidate, Checked):
            vectors[candidate.update_id] = candidate.vector
            if candidate.norm is not None:
                norms[candidate.update_id] = candidate.norm
            continue
        problem = check_structure(candidate.tensors, schema)
        if problem is not None:
            verdicts[candidate.update_id] = ScreeningVerdict(candidate.update_id, False, problem)
        else:
            vectors[candidate.update_id] = flatten(candidate.tensors)
    unmeasured = [update_id for update_id in vectors if update_id not in norms]
    for update_id, norm in zip(unmeasured, measure([vectors[i] for i in unmeasured]), strict=True):
        assert isinstance(norm, float), "a flattened tensor that passed check_structure"
        norms[update_id] = norm
    median_norm = statistics.median(norms.values()) if norms else 0.0
    in_range = _norm_screen(norms, median_norm, spec.max_norm_ratio, verdicts)
    if centre is not None and tuple(in_range) == centre.update_ids:
        dots, centre_norm = list(centre.dots), centre.norm
    else:
        dots, centre_norm = _centre_products([vectors[i] for i in in_range])
    for update_id, dot in zip(in_range, dots, strict=True):
        ratio = norms[update_id] / median_norm if median_norm > 0 else 1.0
        if centre_norm == 0.0 or norms[update_id] == 0.0:
            verdicts[update_id] = ScreeningVerdict(update_id, True, None, norms[update_id], ratio)
            continue
        cosine = dot / (norms[update_id] * centre_norm)
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


def _centre_products(vectors: Sequence[FlatVector]) -> tuple[list[float], float]:
    """The cohort's robust centre -- the coordinate-wise median of ``vectors`` (exactly the
    ``median`` rule's) -- seen only through each vector's dot product with it and its own
    L2 norm (exactly ``dot64`` and ``norm64``), in one pass a window at a time: the centre
    is never held whole. Empty ``vectors``: no products, norm 0."""
    if not vectors:
        return [], 0.0
    n, length = len(vectors), vectors[0].numel()
    workspace = Workspace()
    sums = RowSums(n + 1, length, n + 1, workspace)
    median = TrimmedSpans(n, (n - 1) // 2, workspace)
    kernel = median.native()
    width = min(length, max(sums.span, next(windows(length, sums.span))[1]))
    centre = torch.empty(width, dtype=torch.float32)
    for first, last in windows(length, sums.span):
        spans = [
            span for span in read_window(vectors, first, last) if isinstance(span, torch.Tensor)
        ]
        window = centre[: last - first]
        # the centre itself is the last row: its product with itself is its squared norm
        if kernel is not None and sums.fill_natively(
            [*spans, window], kernel, window, (first, last), base=first, products=True
        ):
            continue
        for start in range(first, last, sums.span):
            end = min(start + sums.span, last)
            local = slice(start - first, end - first)
            span = window[local]
            median.combine(start, [row[local] for row in spans], span)
            terms = sums.terms(start, end, n + 1)
            for i, row in enumerate(spans):
                terms[i].copy_(row[local])
                terms[i].mul_(span)  # float32 x float32 is exact in float64
            terms[n].copy_(span)
            terms[n].mul_(terms[n])
            sums.collect(start, end, 0, n + 1)
    totals = sums.totals()
    return totals[:n], math.sqrt(totals[n])
