"""What each adopted head says became of the trainer's own update: accepted, rejected (with
the quarantine book's reason), left out, or nothing when it sent none."""

from __future__ import annotations

from p2ptrain.core.manifests import ScreeningSpec
from p2ptrain.core.reasons import Code, Reason
from p2ptrain.core.records import Head, QuarantineEntry
from p2ptrain.observe.events import update_outcome
from p2ptrain.protocol.quarantine import next_standings
from tests.support.builders import h

ME = h("me")
NORM = Reason(Code.NORM_ABOVE, (9.0, 4.0))
OTHER = h("other")
MINE = h("my-update")
HEIGHT = 5


def _head(accepted: tuple[str, ...] = (), quarantine: tuple[QuarantineEntry, ...] = ()) -> Head:
    return Head(
        experiment_id=h("exp"),
        height=HEIGHT,
        parent=h("parent"),
        weights_blob=h("weights"),
        optimizer_blob=None,
        accepted=tuple(sorted(accepted)),
        quarantine=quarantine,
        aggregate_blob=h("aggregate"),
    )


def test_no_update_sent_says_nothing() -> None:
    assert update_outcome(_head(accepted=(MINE,)), None, ME) == ""


def test_an_accepted_update() -> None:
    assert update_outcome(_head(accepted=(MINE, h("theirs"))), MINE, ME) == "accepted"


def test_a_rejected_update_gives_the_quarantine_books_reason() -> None:
    standings = next_standings((), HEIGHT, accepted=(), rejected={ME: NORM}, spec=ScreeningSpec())
    assert update_outcome(_head(quarantine=standings), MINE, ME) == (
        "rejected: norm 9.00x the cohort median exceeds 4.0x"
    )


def test_a_trainer_excluded_through_this_window_was_rejected() -> None:
    entry = QuarantineEntry(
        peer_id=ME, until_window=HEIGHT, reason=Reason(Code.REPEATED), offences=1
    )
    assert update_outcome(_head(quarantine=(entry,)), MINE, ME) == (
        "rejected: quarantined for rejected updates in a row (last: trainer sent more than "
        "one update in this window)"
    )


def test_an_update_missing_from_the_head_was_left_out() -> None:
    others = QuarantineEntry(peer_id=OTHER, until_window=0, reason=NORM, strikes=1)
    # a past exclusion, over before this window, is not this window's rejection
    mine_expired = QuarantineEntry(peer_id=ME, until_window=HEIGHT - 1, reason=NORM, offences=1)
    head = _head(accepted=(h("a"), h("b")), quarantine=(mine_expired, others))
    assert update_outcome(head, MINE, ME) == (
        "left out: the window closed with 2 updates without it "
        "(it came late, or the window was full)"
    )


def test_a_late_update_after_an_earlier_rejection_was_left_out() -> None:
    earlier = next_standings((), HEIGHT - 1, (), {ME: NORM}, ScreeningSpec())
    # this window: ME's update came late, so it was neither accepted nor screened
    now = next_standings(earlier, HEIGHT, accepted=(), rejected={}, spec=ScreeningSpec())
    before = _head(quarantine=earlier)
    assert update_outcome(_head(quarantine=now), MINE, ME, before).startswith("left out")
    # ... and a second rejection in this window reads as rejected
    again = next_standings(
        earlier,
        HEIGHT,
        accepted=(),
        rejected={ME: Reason(Code.NOT_FINITE, ("w",))},
        spec=ScreeningSpec(),
    )
    assert update_outcome(_head(quarantine=again), MINE, ME, before).startswith("rejected")
