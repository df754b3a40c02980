"""Metrics reports: which a node takes in, which it keeps, and what they say (DESIGN §4.7).

An evaluator (a validator or viewer whose operator opts in) evaluates each certified head it
adopts and signs a :class:`~p2ptrain.core.records.MetricsReport`. Evaluation is not
bit-reproducible, so a report never enters a head id; it travels beside the chain, and a
node judges each one it receives against the certified chain it holds
(:meth:`MetricsBook.judge`), where ``tip`` is its chain's height:

* a report for another experiment is *rejected* (by the intake rules, against its signer);
* a report for a height at or below ``tip`` must name the head certified there; naming
  another head is *rejected* against its signer (an honest evaluator reports only certified
  heads, and there is one per height);
* a report for ``tip + 1`` (its certificate may still be on its way to us) is *held*, at
  most :data:`MAX_HELD_PER_EVALUATOR` per evaluator and :data:`MAX_HELD` in all, until a
  head is certified at that height: then those naming it are kept and the others dropped;
* a report further ahead, or more than :data:`KEEP_HEIGHTS` below ``tip``, is *ignored*:
  dropped, not forwarded, no strike;
* a second report of one evaluator for one head (a duplicate, or a re-evaluation after a
  restart) and a report for a head that already has :data:`MAX_EVALUATORS_PER_HEAD`
  evaluators are *ignored* too: storage stays bounded, and nobody is struck for it.

Pure: no I/O and no clock; the node persists what :meth:`MetricsBook.add` accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from p2ptrain.core.records import MetricsReport
from p2ptrain.protocol.intake import ACCEPTED, Admission

__all__ = [
    "KEEP_HEIGHTS",
    "MAX_EVALUATORS_PER_HEAD",
    "MAX_HELD",
    "MAX_HELD_PER_EVALUATOR",
    "HeadMetrics",
    "MetricsBook",
    "median",
]

#: Evaluators whose reports a node keeps per head; later ones are ignored.
MAX_EVALUATORS_PER_HEAD = 64
#: Heights below the tip whose reports a node still takes in (and keeps in memory).
KEEP_HEIGHTS = 64
#: Reports for the height after the tip held until its head is certified: in all, and per
#: evaluator.
MAX_HELD = 256
MAX_HELD_PER_EVALUATOR = 2


def median(values: Sequence[float]) -> float | None:
    """The median (the mean of the middle two for an even count); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


@dataclass(frozen=True, slots=True)
class HeadMetrics:
    """What the reports of one head say: their median loss and how many there are."""

    height: int
    head_id: str
    median_loss: float
    reports: int


T = TypeVar("T")


class MetricsBook(Generic[T]):
    """The reports a node holds for the recent certified heads, and its rules for new ones.

    Reports held for the next height are kept with an item of the caller's (the node: the
    signed envelope, to store once the head is certified)."""

    def __init__(
        self,
        *,
        max_per_head: int = MAX_EVALUATORS_PER_HEAD,
        keep_heights: int = KEEP_HEIGHTS,
        max_held: int = MAX_HELD,
    ) -> None:
        self.max_per_head = max_per_head
        self.keep_heights = keep_heights
        self.max_held = max_held
        #: head id -> evaluator key -> loss, for the heads of the last ``keep_heights``.
        self._losses: dict[str, dict[bytes, float]] = {}
        self._height_of: dict[str, int] = {}
        #: record id -> (report, item), for the height after the tip.
        self._held: dict[str, tuple[MetricsReport, T]] = {}

    def judge(
        self, report: MetricsReport, tip: int, certified_at: Callable[[int], str | None]
    ) -> Admission:
        """The verdict on ``report`` for a node whose chain is at height ``tip``;
        ``certified_at(h)`` is the id of the head certified at height ``h`` (h <= tip)."""
        height = report.height
        if height > tip + 1:
            return Admission(False, f"report for height {height}, far ahead of ours ({tip})")
        if height < tip - self.keep_heights:
            return Admission(False, f"report for height {height}, long past (we are at {tip})")
        if height == tip + 1:
            if len(self._held) >= self.max_held:
                return Admission(False, "too many reports wait for their head's certificate")
            mine = sum(1 for r, _ in self._held.values() if r.evaluator == report.evaluator)
            if mine >= MAX_HELD_PER_EVALUATOR:
                return Admission(False, "this evaluator's reports for the next head wait")
            return ACCEPTED
        certified = certified_at(height)
        if certified != report.head_id:
            return Admission(
                False,
                f"report for head {report.head_id[:12]} at height {height}, where head "
                f"{(certified or '?')[:12]} is certified",
                report.evaluator_id,
            )
        return self._room_for(report)

    def _room_for(self, report: MetricsReport) -> Admission:
        losses = self._losses.get(report.head_id, {})
        if report.evaluator in losses:
            return Admission(False, "this evaluator reported on this head already")
        if len(losses) >= self.max_per_head:
            return Admission(False, f"head has {len(losses)} evaluators' reports already")
        return ACCEPTED

    def add(self, report: MetricsReport) -> bool:
        """Keep an accepted report of a certified head; False if there is no room for it
        (already one from its evaluator, or the head is full): the caller stores nothing."""
        if not self._room_for(report).accepted:
            return False
        self._losses.setdefault(report.head_id, {})[report.evaluator] = report.loss
        self._height_of[report.head_id] = report.height
        return True

    def hold(self, record_id: str, report: MetricsReport, item: T) -> None:
        """Keep an accepted report for the height after the tip until it is certified."""
        if len(self._held) < self.max_held:
            self._held[record_id] = (report, item)

    def certified(self, height: int, head_id: str) -> list[T]:
        """Head ``head_id`` is certified at ``height``: the items of the held reports that
        name it (to add and store); those naming another head at that height are dropped,
        and heights long past are forgotten."""
        released: list[T] = []
        for record_id, (report, item) in list(self._held.items()):
            if report.height <= height:
                del self._held[record_id]
                if report.height == height and report.head_id == head_id:
                    released.append(item)
        floor = height - self.keep_heights
        for old in [h for h, at in self._height_of.items() if at < floor]:
            del self._height_of[old]
            self._losses.pop(old, None)
        return released

    def load(self, reports: Iterable[MetricsReport]) -> None:
        """Reports read back from the node's store (restart)."""
        for report in reports:
            self.add(report)

    def losses(self, head_id: str) -> list[float]:
        return sorted(self._losses.get(head_id, {}).values())

    def latest(self) -> HeadMetrics | None:
        """The highest head with reports: their median loss and count."""
        if not self._height_of:
            return None
        head_id = max(self._height_of, key=lambda h: self._height_of[h])
        losses = self.losses(head_id)
        loss = median(losses)
        assert loss is not None
        return HeadMetrics(self._height_of[head_id], head_id, loss, len(losses))

    @property
    def held(self) -> int:
        return len(self._held)
