"""A trainer whose updates are absurd is turned down by screening, with the reason, while
the windows certify with the honest updates.

The network of the dashboard tests (:func:`tests.browser.conftest.start_rejection_net`): a
seed, one validator that proposes, attests (q = 1) and evaluates, two honest trainers and one
whose trained weights move :data:`SCALE` times as far as training moved them, for
:data:`WINDOWS` windows of the tiny char-GPT. Screening compares each update's norm with the
cohort median (the honest norm, with two honest updates in three): the outlier is rejected,
gets a strike in the head's quarantine book, and is quarantined at the third strike.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from p2ptrain.core.reasons import Code
from p2ptrain.core.records import Proposal
from tests.browser.conftest import (
    EVALUATOR,
    FAULTY_TRAINER,
    HONEST_TRAINERS,
    SCALE,
    WINDOWS,
    rejected_reasons,
    start_rejection_net,
)
from tests.support.local_net import Net, stored_chain, stored_records

pytestmark = pytest.mark.integration

#: ``screening.max_norm_ratio``'s default, which the experiment keeps.
MAX_NORM_RATIO = 3.0
#: ``screening.quarantine_after`` and ``quarantine_windows``' defaults.
QUARANTINE_AFTER = 3
QUARANTINE_WINDOWS = 5
#: "norm 1000.00x the cohort median exceeds 3.0x": the ratio is SCALE, give or take the
#: honest trainers' norms differing from each other and the int8 codec's rounding.
NORM_REASON = re.compile(r"norm (\d+\.\d\d)x the cohort median exceeds 3\.0x")


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    net = start_rejection_net(tmp_path_factory.mktemp("rejected-update"))
    try:
        trainers = [*HONEST_TRAINERS, FAULTY_TRAINER]
        net.wait_exits(trainers, 60)
        net.stop([EVALUATOR, "seed"])
        net.check(
            all(net.stopped[n] == WINDOWS for n in trainers),
            f"every trainer should stop at height {WINDOWS}: {net.stopped}",
        )
        yield net
    finally:
        net.close()


def _ratio(reason: str) -> float:
    found = NORM_REASON.search(reason)
    assert found is not None, reason
    return float(found.group(1))


def test_the_outlier_is_rejected_with_its_norm_ratio_and_the_others_accepted(net: Net) -> None:
    for name in HONEST_TRAINERS:
        outcomes = [(e["height"], e["update"]) for e in net.events("adopted", name)]
        assert outcomes == [(h, "accepted") for h in range(1, WINDOWS + 1)], (name, outcomes)
    reasons = rejected_reasons(net)
    assert sorted(reasons) == list(range(1, WINDOWS + 1)), net.events("adopted", FAULTY_TRAINER)
    # the head's book keeps the first reason while the strikes add up ...
    assert reasons[1] == reasons[2] and NORM_REASON.fullmatch(reasons[1]), reasons
    assert 0.5 * SCALE < _ratio(reasons[1]) < 2 * SCALE
    # ... and the third strike quarantines the trainer, saying why
    assert reasons[WINDOWS].startswith("quarantined for rejected updates in a row (last: norm")
    assert 0.5 * SCALE < _ratio(reasons[WINDOWS]) < 2 * SCALE
    # every window certified with the two honest updates
    assert [(e["height"], e["accepted"]) for e in net.events("adopted", "seed")] == [
        (h, len(HONEST_TRAINERS)) for h in range(1, WINDOWS + 1)
    ]


def test_the_heads_quarantine_book_and_the_proposals_say_why(net: Net) -> None:
    faulty = net.peer_ids[FAULTY_TRAINER]
    reasons = rejected_reasons(net)
    chain = stored_chain(net.data_dir("seed"))
    assert [head.height for head, _ in chain] == list(range(1, WINDOWS + 1))
    for head, _certificate in chain:
        [entry] = head.quarantine  # the honest trainers have no standing to keep
        assert entry.peer_id == faulty
        if head.height < QUARANTINE_AFTER:
            assert (entry.strikes, entry.offences, entry.until_window) == (head.height, 0, 0)
            assert entry.describe() == reasons[head.height]
        else:
            assert (entry.strikes, entry.offences) == (0, 1)
            assert entry.until_window == head.height + QUARANTINE_WINDOWS
            assert entry.describe() == reasons[head.height]
    # the proposal of each window names the faulty update among the rejected, with the
    # figure for that window; the honest ones are its accepted updates
    proposals = {
        p.window: p for p in stored_records(net.data_dir("seed"), "proposal", Proposal).values()
    }
    heads = {head.height: head.id for head, _ in chain}
    for height in range(1, WINDOWS + 1):
        proposal = proposals[height]
        assert proposal.head.id == heads[height]
        assert len(proposal.accepted) == len(HONEST_TRAINERS)
        [rejection] = proposal.rejected
        assert rejection.reason.code == Code.NORM_ABOVE
        assert NORM_REASON.fullmatch(rejection.describe()), rejection.describe()
        assert 0.5 * SCALE < _ratio(rejection.describe()) < 2 * SCALE
    assert proposals[1].rejected[0].describe() == reasons[1]
