"""The building blocks of every aggregation rule: streamed passes with exact distances, the
weighted and trimmed span combiners, results with diagnostics, and settings checks.

A rule reads the contributions in *passes*, span by span (:data:`SPAN` values, a few
cache-sized chunks). In one pass it computes its aggregate span by span and, while the inputs
are still in cache, the float64 squared distance from every input to that aggregate
(:class:`RowSums`, bit-identical to :func:`~p2ptrain.aggregate.exact.sqdist64`). Every
operation on values is elementwise (exact per element, see :mod:`p2ptrain.aggregate.exact`)
and every decision is taken on float64 values summed in a fixed order, so the bytes do not
depend on the machine, the thread count or the order of the inputs.

Contributions must be finite (screening rejects anything else); sums of values near the
float32 limit (about 1e37 and up) overflow to infinity.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import torch

from p2ptrain.aggregate import native
from p2ptrain.aggregate.cohort import (
    EXCLUDED,
    FAILED,
    AggregationResult,
    Contribution,
    Failure,
    FlatVector,
    UpdateDiagnostics,
    in_canonical_order,
)
from p2ptrain.aggregate.exact import CHUNK
from p2ptrain.errors import LocalError, ProtocolViolation

#: Values per span of a streamed pass: whole chunks, so the float64 sums keep their tree.
SPAN = 2 * CHUNK
#: Values per window of a pass: each input is read (an update decoded) a window at a time.
WINDOW = 8 * CHUNK
#: Span by span, each chunk's float64 tree is halved down to this many values; its last
#: levels run once for all chunks at the end (same pairs, same order, fewer operations).
TAIL = 256
#: At most this many float64 partial sums are kept (fewer tail values when rows are many).
PARTIAL_BUDGET = 1 << 22
#: Up to this many updates the coordinate-wise rules sort with a network of
#: ``torch.minimum``/``torch.maximum`` (7 to 10 times faster than ``torch.sort`` along the
#: update axis from 8 to 256 updates); above it, with ``torch.sort`` (same values).
NETWORK_MAX_UPDATES = 1024


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32, so torch multiplies by exactly this."""
    return float(torch.tensor(value, dtype=torch.float32))


def halve(work: torch.Tensor, stop: int) -> None:
    """Pairwise-sum the last dimension in place (``x[:h] += x[h:2h]``) down to ``stop``."""
    size = work.shape[-1]
    while size > stop:
        size //= 2
        torch.add(work[..., :size], work[..., size : 2 * size], out=work[..., :size])


class Workspace:
    """Scratch buffers a rule keeps from call to call: fresh memory costs a page fault per
    page, which on some machines is slower than the arithmetic. A workspace serves one call
    at a time, so a rule instance must not be shared between threads."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of ``numel`` values (contents undefined)."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = torch.empty(numel, dtype=dtype)
            self._buffers[key] = buffer
        return buffer[:numel]


class RowSums:
    """Float64 sums of ``rows`` rows of ``length`` terms each, every row summed in exactly
    the order of ``exact._reduce`` (a pairwise tree over each zero-padded :data:`CHUNK`
    block, then one over the block sums), so a row of squared differences sums to the same
    bits as ``sqdist64``. The caller fills up to ``batch_rows`` rows at a time with the terms
    of one span (:meth:`terms`) and hands them back (:meth:`collect`). Each block's tree is
    halved to ``tail`` values (a power of two) as it is filled, the rest at the end: the
    same pairs in the same order, whatever the tail (the C kernel halves cheaply, so a pass
    that is the kernel's alone keeps 1).
    """

    def __init__(
        self,
        rows: int,
        length: int,
        batch_rows: int,
        workspace: Workspace,
        *,
        key: str = "row_sums",
        tail: int = TAIL,
    ) -> None:
        self.length = length
        self.width = CHUNK if length > CHUNK else pow2_at_least(length)
        self.span = SPAN if length > CHUNK else self.width
        blocks = pow2_at_least(max(1, -(-length // CHUNK)))
        # Keep the stored partial sums bounded when there are many rows (Krum's pairs).
        affordable = max(1, PARTIAL_BUDGET // max(1, rows * blocks))
        self.tail = min(tail, self.width, 1 << (affordable.bit_length() - 1))
        partial = workspace.get(f"{key}.partial", rows * blocks * self.tail, torch.float64)
        self._partial = partial.view(rows, blocks, self.tail).zero_()
        self._batch_rows, self._workspace, self._key = batch_rows, workspace, key
        self._scratch_rows: torch.Tensor | None = None

    @property
    def _scratch(self) -> torch.Tensor:
        if self._scratch_rows is None:
            size = self._batch_rows * self.span
            scratch = self._workspace.get(f"{self._key}.scratch", size, torch.float64)
            self._scratch_rows = scratch.view(self._batch_rows, self.span)
        return self._scratch_rows

    def fill_natively(
        self,
        rows: Sequence[FlatVector | None],
        combine: native.Weighted | native.Trimmed | None,
        aggregate: torch.Tensor,
        span: tuple[int, int] | None = None,
        *,
        base: int = 0,
        products: bool = False,
        squares: RowSums | None = None,
        second: tuple[int, torch.Tensor, RowSums] | None = None,
        codes: native.Int8Rows | None = None,
    ) -> bool:
        """The rows' terms (of values ``span = (start, end)``, default all) by the C kernel
        (see :mod:`.native`), after writing the ``combine`` aggregate into ``aggregate``
        when it is given; False (nothing done) when the kernel cannot take them. ``rows``
        and ``aggregate`` may be spans that start at value ``base``. The terms are squared
        differences from the aggregate, or with ``products`` products with it; ``squares``
        (of the same shape) gets each row's squares in the same pass. ``second = (trim,
        out, distances)``, with a trimmed ``combine``: the mean dropping ``trim`` per side
        from the same sort, into ``out`` (a span like ``aggregate``), and each row's
        squared distances to it into ``distances`` (of the same shape). ``codes``: the first
        rows (None in ``rows``) are int8 codes the kernel decodes."""
        if self.width != CHUNK or len(rows) != self._partial.shape[0]:
            return False
        if squares is not None and squares._partial.shape != self._partial.shape:
            return False
        second_mean = None
        if second is not None:
            trim, out, distances = second
            if distances._partial.shape != self._partial.shape:
                return False
            second_mean = native.SecondMean(trim, out, distances._partial)
        tensors: list[torch.Tensor | None] = []
        for row in rows:
            if row is not None and not isinstance(row, torch.Tensor):
                return False
            tensors.append(row)
        blocks = None if span is None else (span[0] // CHUNK, -(-span[1] // CHUNK))
        return native.stream_pass(
            tensors,
            combine,
            aggregate,
            self._partial,
            CHUNK,
            blocks=blocks,
            base=base,
            length=self.length,
            products=products,
            squares=None if squares is None else squares._partial,
            second=second_mean,
            codes=codes,
        )

    def _blocks(self, start: int, end: int) -> int:
        return -(-(end - start) // self.width)  # ceiling division

    def terms(self, start: int, end: int, count: int) -> torch.Tensor:
        """A ``(count, end - start)`` float64 view to fill with the terms of one span;
        ``start`` is a multiple of :attr:`span`. The padding behind it is zero."""
        padded = self._blocks(start, end) * self.width
        if padded > end - start:
            self._scratch[:count, end - start : padded].zero_()
        return self._scratch[:count, : end - start]

    def collect(self, start: int, end: int, first_row: int, count: int) -> None:
        """Halve each block of the filled rows down to :data:`TAIL` values and keep them
        for rows ``first_row .. first_row + count``."""
        blocks = self._blocks(start, end)
        work = self._scratch[:count, : blocks * self.width].view(count, blocks, self.width)
        halve(work, self.tail)
        first_block = start // CHUNK
        rows = slice(first_row, first_row + count)
        self._partial[rows, first_block : first_block + blocks].copy_(work[..., : self.tail])

    def totals(self) -> list[float]:
        """The per-row sums: the last levels of every block's tree, then the tree over the
        block sums (zero-padded to a power of two)."""
        halve(self._partial, 1)
        block_sums = self._partial[..., 0]
        halve(block_sums, 1)
        return [float(value) for value in block_sums[:, 0].tolist()]


class SpanCombiner(Protocol):
    """Computes one span of an aggregate from the same span of every contribution."""

    def combine(
        self, start: int, rows: Sequence[torch.Tensor], out: torch.Tensor
    ) -> torch.Tensor | None:
        """Write the aggregate of ``rows`` (each contribution's values ``start .. start +
        len(out)``) into ``out``; may return a float32 stack of the rows' values (-0.0 may be
        +0.0 there), from which distances are then measured in one operation."""
        ...


@runtime_checkable
class NativeCombiner(Protocol):
    """A combiner the C kernel can also compute (with the same bits)."""

    def native(self) -> native.Weighted | native.Trimmed | None:
        """The kernel's description of this combination, or None if it cannot run it."""
        ...


def windows(length: int, span: int, window: int = WINDOW) -> Iterator[tuple[int, int]]:
    """``(first, last)`` of each ``window`` of a pass over ``length`` values (whole spans
    of ``span`` values, which divides the window)."""
    step = max(window, span)
    for first in range(0, length, step):
        yield first, min(first + step, length)


@functools.cache
def _readers(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="p2ptrain-read")


def read_window(
    vectors: Sequence[FlatVector | None], first: int, last: int
) -> list[torch.Tensor | ProtocolViolation | None]:
    """Each vector's values ``first .. last`` (None stays None): tensors are sliced, updates
    read and decoded -- on as many threads as torch may use (the reads and the decoding
    release the GIL). A read that raises :class:`ProtocolViolation` gives the violation."""

    def read(vector: FlatVector | None) -> torch.Tensor | ProtocolViolation | None:
        if vector is None:
            return None
        try:
            return vector[first:last]
        except ProtocolViolation as violation:
            return violation

    threads = torch.get_num_threads()
    if threads == 1 or _in_memory(vectors) or len(vectors) < 2:
        return [read(vector) for vector in vectors]
    return list(_readers(threads).map(read, vectors))


def _window(
    vectors: Sequence[FlatVector | None], first: int, last: int
) -> list[torch.Tensor | None]:
    """:func:`read_window` of vectors that passed the first pass (no read can fail)."""
    spans: list[torch.Tensor | None] = []
    for span in read_window(vectors, first, last):
        if isinstance(span, ProtocolViolation):
            raise span
        spans.append(span)
    return spans


def _in_memory(vectors: Sequence[FlatVector | None]) -> bool:
    return all(vector is None or isinstance(vector, torch.Tensor) for vector in vectors)


def stream_pass(
    vectors: Sequence[FlatVector],
    combiner: SpanCombiner,
    workspace: Workspace,
    references: Sequence[torch.Tensor | None] = (),
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """One streamed pass: the aggregate (written into ``out`` when given), and the float64
    squared distance from it to each of ``vectors`` and then each of ``references`` (None
    stands for the zero vector, giving the aggregate's squared norm). Each distance is
    bit-identical to ``sqdist64``: the float32 difference, squared in float64, summed by
    its tree. Each vector is read once, a window at a time (:func:`windows`)."""
    n, length = len(vectors), vectors[0].numel()
    aggregate = torch.empty(length, dtype=torch.float32) if out is None else out
    rows = n + len(references)
    sums = RowSums(rows, length, rows, workspace)
    native_combine = combiner.native() if isinstance(combiner, NativeCombiner) else None
    inputs: list[FlatVector | None] = [*vectors, *references]
    if (
        native_combine is not None
        and _in_memory(inputs)
        and sums.fill_natively(inputs, native_combine, aggregate)
    ):
        return aggregate, sums.totals()
    for first, last in windows(length, sums.span):
        spans = _window(inputs, first, last)
        if native_combine is not None and sums.fill_natively(
            spans, native_combine, aggregate[first:last], (first, last), base=first
        ):
            continue
        for start in range(first, last, sums.span):
            end = min(start + sums.span, last)
            local = slice(start - first, end - first)
            span = aggregate[start:end]
            values = [row[local] for row in spans[:n] if row is not None]
            stack = combiner.combine(start, values, span)
            if sums.fill_natively(spans, None, aggregate[first:last], (start, end), base=first):
                continue
            terms = sums.terms(start, end, rows)
            # float32 differences (one rounding each), widened to float64 as they are written
            if stack is not None:
                torch.sub(stack, span, out=terms[:n])
            else:
                for i, value in enumerate(values):
                    torch.sub(value, span, out=terms[i])
            for j, reference in enumerate(spans[n:], start=n):
                if reference is None:
                    terms[j].copy_(span)  # 0 - x squares to the same value as x
                else:
                    torch.sub(reference[local], span, out=terms[j])
            terms.mul_(terms)
            sums.collect(start, end, 0, rows)
    return aggregate, sums.totals()


class WeightedSpans:
    """``sum_i c_i * rows[i]`` over the chosen rows, in their order, with each ``c_i``
    rounded to float32 and separate multiply and add."""

    def __init__(
        self, indices: Sequence[int], coefficients: Sequence[float], workspace: Workspace
    ) -> None:
        if len(indices) != len(coefficients) or not indices:
            raise LocalError("a weighted combination needs one coefficient per chosen row")
        self.indices = list(indices)
        self.coefficients = [float32(c) for c in coefficients]
        self._scratch = workspace.get("weighted.scratch", SPAN, torch.float32)

    def native(self) -> native.Weighted:
        return native.Weighted(list(zip(self.indices, self.coefficients, strict=True)))

    def combine(
        self, start: int, rows: Sequence[torch.Tensor], out: torch.Tensor
    ) -> torch.Tensor | None:
        tmp = self._scratch[: out.numel()]
        pairs = zip(self.indices, self.coefficients, strict=True)
        first, c_first = next(pairs)
        torch.mul(rows[first], c_first, out=out)
        for index, c in pairs:
            torch.mul(rows[index], c, out=tmp)
            torch.add(out, tmp, out=out)
        return None


def weighted_pass(
    vectors: Sequence[FlatVector],
    chosen: Sequence[int],
    weights: Sequence[float],
    workspace: Workspace,
    references: Sequence[torch.Tensor | None] = (),
    *,
    out: torch.Tensor | None = None,
) -> tuple[list[float], torch.Tensor, list[float]]:
    """:func:`stream_pass` of the weighted mean of ``vectors[i]`` for ``i`` in ``chosen``
    (``weights`` in that order, normalised by :func:`shares`): the coefficients used, the
    aggregate and the squared distances."""
    coefficients = shares(weights)
    combiner = WeightedSpans(chosen, coefficients, workspace)
    aggregate, squares = stream_pass(vectors, combiner, workspace, references, out=out)
    return coefficients, aggregate, squares


@functools.cache
def sorting_network(n: int, low: int, high: int) -> tuple[tuple[int, int], ...]:
    """Comparators ``(a, b)``, ``a < b`` (min to ``a``, max to ``b``) of Batcher's odd-even
    merge sort for ``n`` wires, keeping only those that decide ranks ``low..high``."""
    size = pow2_at_least(n)
    network: list[tuple[int, int]] = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        network.append((i + j, i + j + k))
            k //= 2
        p *= 2
    # Wires >= n would carry +inf and never move, so comparators touching them do nothing.
    needed = set(range(low, high + 1))
    kept: list[tuple[int, int]] = []
    for a, b in reversed([(a, b) for a, b in network if b < n]):
        if a in needed or b in needed:
            kept.append((a, b))
            needed.update((a, b))
    kept.reverse()
    return tuple(kept)


class TrimmedSpans:
    """Coordinate-wise: sort the ``n`` values, drop ``trim`` from each side and average the
    rest: ``(x_trim + ... + x_{n-1-trim}) / (n - 2 trim)``, adds in rank order, then one
    division. With ``trim = (n - 1) // 2`` this is the median; for even ``n``, ``(a + b) / 2``
    (the same bits as ``(a + b) * 0.5``). -0.0 becomes +0.0 first (``x + 0.0``), so equal
    values are equal bits and the order of ties never matters.

    It also counts, per input, the coordinates outside ``[x_trim, x_{n-1-trim}]``: those
    where its value was dropped. A value equal to a kept one counts as kept.
    """

    def __init__(self, n: int, trim: int, workspace: Workspace) -> None:
        self.n, self.trim = n, trim
        self.kept = n - 2 * trim
        self.dropped = torch.zeros(n, dtype=torch.int64)
        self._stack = workspace.get("trimmed.stack", n * SPAN, torch.float32)
        self._work = workspace.get("trimmed.work", (n + 1) * SPAN, torch.float32)
        self._masks = workspace.get("trimmed.masks", 2 * n * SPAN, torch.float32)
        self._network: tuple[tuple[int, int], ...] | None = None
        if n <= NETWORK_MAX_UPDATES:
            self._network = sorting_network(n, trim, n - 1 - trim)
        else:
            self._indices = workspace.get("trimmed.indices", n * SPAN, torch.int64)

    def native(self) -> native.Trimmed | None:
        if self._network is None:
            return None
        return native.Trimmed(self.n, self.trim, self._network, self.dropped)

    def combine(
        self, start: int, rows: Sequence[torch.Tensor], out: torch.Tensor
    ) -> torch.Tensor | None:
        width = out.numel()
        stack = self._stack[: self.n * width].view(self.n, width)
        for i, row in enumerate(rows):
            torch.add(row, 0.0, out=stack[i])  # -0.0 + 0.0 = +0.0
        ranked = self._sorted(stack, width)
        if self.kept == 1:
            out.copy_(ranked[self.trim])
        else:
            torch.add(ranked[self.trim], ranked[self.trim + 1], out=out)
        for rank in range(self.trim + 2, self.n - self.trim):
            torch.add(out, ranked[rank], out=out)
        if self.kept > 1:
            torch.div(out, float(self.kept), out=out)
        if self.trim:
            self._count_dropped(stack, ranked[self.trim], ranked[self.n - 1 - self.trim])
        return stack

    def _sorted(self, stack: torch.Tensor, width: int) -> list[torch.Tensor]:
        """The rows of ``stack`` sorted per coordinate, as a list of rows by rank (only
        ranks ``trim .. n-1-trim`` are meaningful). ``stack`` itself is left as it is."""
        work = self._work[: (self.n + 1) * width].view(self.n + 1, width)
        if self._network is None:
            values = work[: self.n]
            indices = self._indices[: self.n * width].view(self.n, width)
            torch.sort(stack, dim=0, out=(values, indices))
            return list(values)
        # Wires start as the stack's rows; a wire is moved into a work row when first written.
        wires = list(stack)
        owned = [False] * self.n
        free = list(work)
        for a, b in self._network:
            low = free.pop()
            torch.minimum(wires[a], wires[b], out=low)
            if owned[b]:
                torch.maximum(wires[a], wires[b], out=wires[b])
            else:
                high = free.pop()
                torch.maximum(wires[a], wires[b], out=high)
                wires[b], owned[b] = high, True
            if owned[a]:
                free.append(wires[a])
            wires[a], owned[a] = low, True
        return wires

    def _count_dropped(self, stack: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> None:
        """Add, per row, the coordinates below ``low`` or above ``high``. The comparisons
        are written as 0.0/1.0 and summed in float32: every partial sum is an integer of at
        most :data:`SPAN` < 2**24, so the count is exact whatever order torch adds in."""
        below_above = self._masks[: 2 * stack.numel()].view(2, *stack.shape)
        torch.lt(stack, low, out=below_above[0])
        torch.gt(stack, high, out=below_above[1])
        counts = below_above.sum(dim=2)
        self.dropped.add_(counts[0].to(torch.int64)).add_(counts[1].to(torch.int64))


@dataclass(frozen=True, slots=True)
class Ranked:
    """A trimmed mean taken ahead of a rule's own pass (screening's first pass sorts every
    coordinate anyway): of the updates ``update_ids`` (in update-id order), ``trim`` values
    dropped per side, each update's squared distance to it and its count of dropped
    coordinates. A rule that is exactly this mean takes it instead of reading the cohort
    again (``rules.RankedRule``)."""

    update_ids: tuple[str, ...]
    trim: int
    aggregate: torch.Tensor
    squares: tuple[float, ...]
    dropped: tuple[int, ...]


# --- cohorts and results ------------------------------------------------------------------


def prepare(
    contributions: Sequence[Contribution], failures: Sequence[Failure], out: torch.Tensor | None
) -> list[Contribution]:
    """The contributions in update-id order, after checking that every update id appears
    once in the cohort and that ``out`` (if any) can hold the aggregate."""
    ordered = in_canonical_order(contributions)
    for contribution in ordered:
        vector = contribution.vector
        if isinstance(vector, torch.Tensor) and vector.device.type != "cpu":
            raise LocalError(
                f"update {contribution.update_id[:16]} is on {vector.device}; "
                "canonical aggregation runs on the CPU (pass vector.cpu())"
            )
    seen = {c.update_id for c in ordered}
    for failure in failures:
        if failure.update_id in seen:
            raise LocalError(
                f"update {failure.update_id[:16]} appears twice in one cohort; pass each "
                "update once, as a contribution or as a failure"
            )
        seen.add(failure.update_id)
    if out is not None and ordered:
        length = ordered[0].vector.numel()
        if out.dtype != torch.float32 or out.shape != (length,) or not out.is_contiguous():
            raise LocalError(
                f"out must be a contiguous 1-D float32 tensor of {length} values, like the "
                f"contributions; got {out.dtype} of shape {tuple(out.shape)}"
            )
        storage = out.untyped_storage().data_ptr()
        if any(
            isinstance(c.vector, torch.Tensor) and c.vector.untyped_storage().data_ptr() == storage
            for c in ordered
        ):
            raise LocalError("out shares memory with a contribution; pass a separate buffer")
    return ordered


def _with_failures(
    found: list[UpdateDiagnostics], failures: Sequence[Failure]
) -> tuple[UpdateDiagnostics, ...]:
    failed = [UpdateDiagnostics(f.update_id, FAILED, None, f.reason) for f in failures]
    return tuple(sorted(found + failed, key=lambda d: d.update_id))


def no_aggregate(
    ordered: Sequence[Contribution], failures: Sequence[Failure], reason: str
) -> AggregationResult:
    """The result of a rule that cannot produce an aggregate from this cohort."""
    diagnostics = [UpdateDiagnostics(c.update_id, EXCLUDED, None, reason) for c in ordered]
    return AggregationResult(None, _with_failures(diagnostics, failures), reason)


@dataclass(frozen=True, slots=True)
class RuleVerdict:
    """What a rule did with one contribution: its status and a human-readable detail."""

    status: str
    detail: str = ""


def result(
    ordered: Sequence[Contribution],
    failures: Sequence[Failure],
    *,
    aggregate: torch.Tensor,
    squares: Sequence[float],
    verdicts: Sequence[RuleVerdict],
    reason: str,
) -> AggregationResult:
    """An aggregate with one diagnostic per update; distances are the square roots of the
    exact float64 squared distances (``math.sqrt`` is correctly rounded everywhere)."""
    diagnostics = [
        UpdateDiagnostics(c.update_id, v.status, math.sqrt(d2), v.detail)
        for c, v, d2 in zip(ordered, verdicts, squares, strict=True)
    ]
    return AggregationResult(aggregate, _with_failures(diagnostics, failures), reason)


def shares(weights: Sequence[float]) -> list[float]:
    """``w_i / sum(w)`` in float64, the sum taken in the given (update-id) order."""
    total = 0.0
    for weight in weights:
        total += weight
    return [weight / total for weight in weights]


def check_int_setting(key: str, value: object, low: int, high: int) -> None:
    """A rule's integer setting ``aggregation.config.<key>`` must lie in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LocalError(
            f"aggregation.config.{key} must be an integer from {low} to {high}, got {value!r}"
        )


def check_float_setting(
    key: str, value: object, low: float, high: float = math.inf, *, low_included: bool = True
) -> None:
    """A rule's number setting ``aggregation.config.<key>`` must be finite and lie in
    ``[low, high)`` (``(low, high)`` when ``low_included`` is False)."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (low <= value if low_included else low < value)
        and value < high
    )
    if not ok:
        interval = f"{'[' if low_included else '('}{low}, {high})"
        raise LocalError(f"aggregation.config.{key} must be a number in {interval}, got {value!r}")


ConfigT = TypeVar("ConfigT")


class RuleBase(Generic[ConfigT]):
    """What every rule shares: a frozen config (the rule's default when none is given), a
    private :class:`Workspace` reused across windows (so an instance is not thread-safe),
    and :meth:`aggregate`, which sorts and checks the cohort before the rule's own
    :meth:`_aggregate`. ``empty_reason`` answers an empty cohort, unless it is None.
    A rule names its config class once: ``class Mean(RuleBase[MeanConfig], config=MeanConfig)``.
    """

    name: str
    empty_reason: ClassVar[str | None]
    _default_config: ClassVar[Callable[[], Any]]

    def __init_subclass__(cls, *, config: Callable[[], Any], **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._default_config = config

    def __init__(self, config: ConfigT | None = None) -> None:
        self.config: ConfigT = type(self)._default_config() if config is None else config
        self._workspace = Workspace()

    def aggregate(
        self,
        contributions: Sequence[Contribution],
        failures: Sequence[Failure] = (),
        *,
        out: torch.Tensor | None = None,
    ) -> AggregationResult:
        """Aggregate the cohort (into ``out`` when given: reuse one buffer across windows)."""
        ordered = prepare(contributions, failures, out)
        if not ordered and self.empty_reason is not None:
            return no_aggregate(ordered, failures, self.empty_reason)
        return self._aggregate(ordered, failures, out)

    def _aggregate(
        self, ordered: list[Contribution], failures: Sequence[Failure], out: torch.Tensor | None
    ) -> AggregationResult:
        raise NotImplementedError
