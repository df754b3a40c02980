"""Metrics reports: the record's bounds, its envelope, the intake rules of a node (unknown
head, duplicates, the bound per head, held reports), the median, storage and the evaluator's
step."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from p2ptrain.core.encoding import decode, encode
from p2ptrain.core.envelope import open_envelope, seal
from p2ptrain.core.records import MetricsReport
from p2ptrain.driver.failures import FailureBook, RoleFailed
from p2ptrain.errors import InvalidRecord, LocalError, ProtocolViolation
from p2ptrain.node.evaluator import HeadEvaluator, evaluate_head
from p2ptrain.node.persist import NodeStore, median_val_loss
from p2ptrain.observe.events import Evaluated, NodeEvent, RoleFailure
from p2ptrain.protocol.metrics import MetricsBook, median
from p2ptrain.store.datadir import DataDir
from tests.support.builders import certified_chain, experiment, h, identity

ALICE = identity(1)
BOB = identity(2)


def report(**changes: object) -> MetricsReport:
    fields: dict[str, object] = {
        "experiment_id": h("exp"),
        "height": 3,
        "head_id": h("head-3"),
        "evaluator": ALICE.public_key,
        "loss": 2.5,
        "perplexity": math.exp(2.5),
        "samples": 512,
    }
    fields.update(changes)
    return MetricsReport(**fields)  # type: ignore[arg-type]


# -- the record ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"experiment_id": "abc"}, "experiment_id"),
        ({"height": -1}, "height"),
        ({"head_id": "ABC"}, "head_id"),
        ({"evaluator": b"short"}, "evaluator"),
        ({"loss": float("nan")}, "loss"),
        ({"loss": float("inf")}, "loss"),
        ({"loss": 1e10}, "loss"),
        ({"perplexity": -1.0}, "perplexity"),
        ({"perplexity": float("inf")}, "perplexity"),
        ({"samples": -1}, "samples"),
        ({"samples": 1 << 41}, "samples"),
    ],
)
def test_a_report_refuses_bad_fields(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRecord) as info:
        report(**changes)
    assert info.value.field == field


def test_a_report_round_trips_and_its_envelope_verifies() -> None:
    original = report(perplexity=None, samples=0)
    assert decode(MetricsReport, encode(original), max_bytes=1024) == original
    signed = seal(ALICE, report())
    opened = open_envelope(signed.envelope.encode(), MetricsReport)
    assert opened.record == report() and opened.envelope.kind == "metrics"
    assert opened.record_id == report().id


def test_a_report_is_sealed_only_by_its_evaluator_and_a_forged_one_fails() -> None:
    with pytest.raises(LocalError):
        seal(BOB, report())
    signed = seal(ALICE, report())
    forged = type(signed.envelope)(
        kind="metrics",
        payload=encode(report(loss=0.1)),
        signer=ALICE.public_key,
        signature=signed.envelope.signature,
    )
    with pytest.raises(ProtocolViolation, match="invalid signature"):
        open_envelope(forged.encode(), MetricsReport)


# -- the median ---------------------------------------------------------------------------


def test_median_by_hand() -> None:
    assert median([]) is None
    assert median([3.0]) == 3.0
    assert median([5.0, 1.0, 3.0]) == 3.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5


# -- intake -------------------------------------------------------------------------------

CERTIFIED = {h: h_id for h, h_id in ((i, h(f"head-{i}")) for i in range(6))}


def judge(book: MetricsBook[str], r: MetricsReport, tip: int = 5) -> tuple[bool, str | None]:
    verdict = book.judge(r, tip, CERTIFIED.get)
    return verdict.accepted, verdict.blame


def test_a_report_of_the_certified_head_is_taken_once_per_evaluator() -> None:
    book: MetricsBook[str] = MetricsBook()
    first = report()
    assert judge(book, first) == (True, None)
    assert book.add(first)
    # the same evaluator again (a duplicate or a re-evaluation): ignored, no strike
    assert judge(book, report(loss=2.4)) == (False, None)
    assert not book.add(report(loss=2.4))
    assert judge(book, report(evaluator=BOB.public_key)) == (True, None)


def test_a_report_naming_another_head_at_a_certified_height_counts_against_its_signer() -> None:
    book: MetricsBook[str] = MetricsBook()
    accepted, blame = judge(book, report(head_id=h("not certified")))
    assert not accepted and blame == ALICE.peer_id


def test_reports_far_ahead_or_long_past_are_ignored() -> None:
    book: MetricsBook[str] = MetricsBook(keep_heights=2)
    assert judge(book, report(height=7, head_id=h("future"))) == (False, None)
    assert judge(book, report(height=2, head_id=CERTIFIED[2])) == (False, None)
    assert judge(book, report(height=3, head_id=CERTIFIED[3])) == (True, None)


def test_a_head_keeps_at_most_max_evaluators() -> None:
    book: MetricsBook[str] = MetricsBook(max_per_head=3)
    for n in range(3):
        assert book.add(report(evaluator=identity(10 + n).public_key, loss=float(n)))
    late = report(evaluator=identity(20).public_key)
    assert judge(book, late) == (False, None)
    assert not book.add(late)
    assert book.losses(h("head-3")) == [0.0, 1.0, 2.0]


def test_reports_for_the_next_height_wait_for_its_certificate_bounded() -> None:
    book: MetricsBook[str] = MetricsBook(max_held=3)
    ahead = [
        report(height=6, head_id=h("head-6"), evaluator=identity(30 + n).public_key)
        for n in range(3)
    ]
    wrong = report(height=6, head_id=h("head-6 other"), evaluator=identity(40).public_key)
    for n, r in enumerate(ahead[:2]):
        assert judge(book, r) == (True, None)
        book.hold(f"r{n}", r, f"item{n}")
    # at most two per evaluator
    twice = report(height=6, head_id=h("head-6"), evaluator=ahead[0].evaluator, loss=1.0)
    book.hold("r-twice", twice, "twice")
    assert judge(book, report(height=6, head_id=h("x"), evaluator=ahead[0].evaluator)) == (
        False,
        None,
    )
    assert judge(book, wrong) == (False, None)  # held in all: 3, the bound
    assert book.held == 3
    released = book.certified(6, h("head-6"))
    assert released == ["item0", "item1", "twice"]
    assert book.held == 0


def test_the_latest_head_with_reports_and_its_median() -> None:
    book: MetricsBook[str] = MetricsBook()
    assert book.latest() is None
    book.add(report(height=2, head_id=CERTIFIED[2], loss=9.0))
    for n, loss in enumerate([3.0, 1.0, 2.0, 10.0]):
        book.add(report(evaluator=identity(50 + n).public_key, loss=loss))
    latest = book.latest()
    assert latest is not None
    assert (latest.height, latest.head_id, latest.median_loss, latest.reports) == (
        3,
        CERTIFIED[3],
        2.5,
        4,
    )


# -- storage ------------------------------------------------------------------------------


def test_reports_are_stored_per_certified_head_and_give_the_median(tmp_path: Path) -> None:
    validators = [identity(i) for i in range(3)]
    manifest = experiment(validators, 2)
    chain = certified_chain(manifest, validators[:2], 3)
    with DataDir(tmp_path) as datadir:
        store = NodeStore(datadir)
        store.remember_experiment(manifest.id)
        for height in range(1, 4):
            link = chain.at(height)
            assert link is not None and link.certificate is not None
            store.put_link(link.head, link.certificate)
        head = chain.at(2)
        assert head is not None
        assert median_val_loss(store, head.head_id) == (None, 0)
        sealed = []
        for n, loss in enumerate([2.0, 4.0, 3.0]):
            evaluator = identity(60 + n)
            r = report(
                experiment_id=manifest.id,
                height=2,
                head_id=head.head_id,
                evaluator=evaluator.public_key,
                loss=loss,
            )
            sealed.append(seal(evaluator, r))
            assert store.put_report(sealed[-1])
        assert not store.put_report(sealed[0])  # stored already
        assert median_val_loss(store, head.head_id) == (3.0, 3)
        assert median_val_loss(store, h("unknown")) == (None, 0)
        assert len(store.metrics_reports(manifest.id, min_height=3)) == 0


# -- the evaluator ------------------------------------------------------------------------


class _Workload:
    language_model = True
    validation_samples = 96

    def __init__(self, losses: list[float | Exception]) -> None:
        self.losses = losses

    def evaluate(self, weights: Mapping[str, torch.Tensor]) -> float:
        outcome = self.losses.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_evaluate_head_reports_perplexity_for_a_language_model_only() -> None:
    workload = _Workload([1.5, 1.5])
    assert evaluate_head(workload, {}) == (1.5, math.exp(1.5), 96)  # type: ignore[arg-type]
    workload.language_model = False
    assert evaluate_head(workload, {}) == (1.5, None, 96)  # type: ignore[arg-type]


class _Services:
    """What the evaluator uses of the node's services."""

    experiment_id = h("exp")
    peer_id = ALICE.peer_id

    def __init__(self) -> None:
        self.published: list[tuple[str, MetricsReport]] = []

        class _Storage:
            def check(self, what: str, exc: BaseException) -> bool:
                return False

        self.storage = _Storage()

    def publish(self, kind: str, signed: object) -> None:
        self.published.append((kind, signed.record))  # type: ignore[attr-defined]


def test_the_evaluator_skips_stale_heads_and_records_a_failing_evaluation() -> None:
    services = _Services()
    events: list[NodeEvent] = []
    workload = _Workload([2.0, RuntimeError("broken eval"), 1.0])
    failures = FailureBook(limit=2)
    evaluator = HeadEvaluator(
        workload=workload,  # type: ignore[arg-type]
        manifest=experiment([ALICE], 1),
        identity=ALICE,
        services=services,  # type: ignore[arg-type]
        failures=failures,
        emit=events.append,
    )
    evaluator._evaluate_blob = lambda offer: evaluate_head(workload, {})  # type: ignore[method-assign,assignment,arg-type]

    async def scenario() -> None:
        task = asyncio.create_task(evaluator.run())
        evaluator.offer(1, h("head-1"), h("w1"))
        await _until(lambda: len(events) == 1)
        # two heads adopted while it was busy: only the newest is evaluated
        evaluator.offer(2, h("head-2"), h("w2"))
        evaluator.offer(3, h("head-3"), h("w3"))
        await _until(lambda: len(events) == 2)
        evaluator.offer(4, h("head-4"), h("w4"))
        await _until(lambda: len(events) == 3)
        task.cancel()

    asyncio.run(scenario())
    first, failed, last = events
    assert isinstance(first, Evaluated) and first.loss == 2.0 and first.samples == 96
    assert isinstance(failed, RoleFailure) and failed.role == "evaluator"
    assert failed.window == 3 and failed.failures == 1 and "broken eval" in failed.message
    assert isinstance(last, Evaluated) and last.height == 4 and last.skipped == 0
    assert [(k, r.height, r.loss) for k, r in services.published] == [
        ("metrics", 1, 2.0),
        ("metrics", 4, 1.0),
    ]
    assert failures.in_a_row("evaluator") == 0  # a good evaluation cleared it
    assert evaluator.skipped == 1


def test_an_evaluator_that_keeps_failing_ends_the_node() -> None:
    services = _Services()
    workload = _Workload([RuntimeError("one"), RuntimeError("two")])
    evaluator = HeadEvaluator(
        workload=workload,  # type: ignore[arg-type]
        manifest=experiment([ALICE], 1),
        identity=ALICE,
        services=services,  # type: ignore[arg-type]
        failures=FailureBook(limit=2),
        emit=lambda event: None,
    )
    evaluator._evaluate_blob = lambda offer: evaluate_head(workload, {})  # type: ignore[method-assign,assignment,arg-type]

    async def scenario() -> None:
        task = asyncio.create_task(evaluator.run())
        evaluator.offer(1, h("head-1"), h("w1"))
        await _until(lambda: len(workload.losses) == 1)
        evaluator.offer(2, h("head-2"), h("w2"))
        async with asyncio.timeout(10):
            await task

    with pytest.raises(RoleFailed, match="the evaluator role failed 2 times in a row"):
        asyncio.run(scenario())


async def _until(condition: object, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.005)
