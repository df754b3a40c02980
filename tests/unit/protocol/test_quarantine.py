"""Quarantine standings, hand-computed window by window."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from p2ptrain.core.encoding import decode, encode
from p2ptrain.core.manifests import ScreeningSpec
from p2ptrain.core.reasons import Code, Reason
from p2ptrain.core.records import Head, QuarantineEntry
from p2ptrain.protocol.quarantine import MAX_EXCLUSION, excluded_until, next_standings
from tests.support.builders import h

SPEC = ScreeningSpec(quarantine_after=3, quarantine_windows=5)
A, B, C = sorted([h("peer-a"), h("peer-b"), h("peer-c")])
BAD = Reason(Code.BLOB_MISMATCH)
NORM = Reason(Code.NORM_ABOVE, (9.0, 3.0))
NAN = Reason(Code.NOT_FINITE, ("w",))
WORSE = Reason(Code.REPEATED)
WORST = Reason(Code.UNDECODABLE)
X = Reason(Code.LEASE_SHARDS, (1,))
Y = Reason(Code.LEASE_SAMPLES, (3, 4))


def run(
    windows: Iterable[tuple[int, Sequence[str], Mapping[str, Reason]]],
    start: Sequence[QuarantineEntry] = (),
    spec: ScreeningSpec = SPEC,
) -> tuple[QuarantineEntry, ...]:
    """The standings after a sequence of (window, accepted, rejected) outcomes."""
    standings = tuple(start)
    for window, accepted, rejected in windows:
        standings = next_standings(standings, window, accepted, rejected, spec)
    return standings


def entry(standings: Sequence[QuarantineEntry], peer_id: str) -> QuarantineEntry | None:
    matches = [e for e in standings if e.peer_id == peer_id]
    assert len(matches) <= 1
    return matches[0] if matches else None


def held(standings: Sequence[QuarantineEntry], peer_id: str) -> QuarantineEntry:
    """The entry of ``peer_id``, which must have one."""
    found = entry(standings, peer_id)
    assert found is not None, f"no entry for {peer_id[:12]}"
    return found


def strikes_of(standings: Sequence[QuarantineEntry], peer_id: str) -> int:
    found = entry(standings, peer_id)
    return 0 if found is None else found.strikes


def test_no_outcomes_no_standings() -> None:
    assert next_standings((), 1, [], {}, SPEC) == ()
    assert next_standings((), 1, [A, B], {}, SPEC) == ()


def test_a_rejection_is_a_strike_with_its_reason() -> None:
    standings = run([(1, [B], {A: NORM})])
    assert standings == (QuarantineEntry(peer_id=A, until_window=0, reason=NORM, strikes=1),)
    assert excluded_until(standings, A, 2) is None


def test_strikes_accumulate_and_reset_on_acceptance() -> None:
    after_two = run([(1, [], {A: BAD}), (2, [], {A: BAD})])
    assert strikes_of(after_two, A) == 2
    assert entry(after_two, A) == QuarantineEntry(peer_id=A, until_window=0, reason=BAD, strikes=2)
    # Accepted: strikes cleared, and with nothing left the entry is dropped.
    after_accept = next_standings(after_two, 3, [A], {}, SPEC)
    assert after_accept == ()
    # Strikes start over: two more rejections are not yet a quarantine.
    later = run([(4, [], {A: BAD}), (5, [], {A: BAD})], start=after_accept)
    assert entry(later, A) == QuarantineEntry(peer_id=A, until_window=0, reason=BAD, strikes=2)
    assert excluded_until(later, A, 6) is None


def test_quarantine_after_k_strikes_for_m_windows() -> None:
    standings = run([(1, [], {A: BAD}), (2, [], {A: BAD}), (3, [], {A: NAN})])
    assert standings == (
        QuarantineEntry(
            peer_id=A,
            until_window=8,  # window 3 + 5 windows: excluded from windows 4..8
            reason=NAN,
            strikes=0,
            offences=1,
        ),
    )


def test_excluded_until_covers_exactly_the_windows_through_until_window() -> None:
    standings = run([(w, [], {A: BAD}) for w in (1, 2, 3)])
    for window in range(4, 9):
        assert excluded_until(standings, A, window) == 8
    for window in (9, 10, 100):
        assert excluded_until(standings, A, window) is None
    assert excluded_until(standings, B, 5) is None
    assert excluded_until((), A, 5) is None


def test_a_strike_only_entry_excludes_nobody() -> None:
    standings = run([(1, [], {A: BAD})])
    assert excluded_until(standings, A, 1) is None
    assert excluded_until(standings, A, 2) is None


def test_an_excluded_trainers_entry_stays_until_its_exclusion_ends() -> None:
    """During exclusion the trainer is neither accepted nor rejected (no strike); its entry
    carries over unchanged."""
    standings = run([(w, [], {A: BAD}) for w in (1, 2, 3)])
    quarantined = entry(standings, A)
    for window in range(4, 12):
        standings = next_standings(standings, window, [B], {}, SPEC)
        assert entry(standings, A) == quarantined
    assert entry(standings, B) is None


def test_a_repeat_offence_doubles_the_exclusion() -> None:
    first = run([(w, [], {A: BAD}) for w in (1, 2, 3)])  # out for 5: through 8
    assert held(first, A).until_window == 8
    second = run([(w, [], {A: WORSE}) for w in (9, 10, 11)], start=first)
    assert entry(second, A) == QuarantineEntry(
        peer_id=A,
        until_window=21,  # 11 + 5 * 2
        reason=WORSE,
        strikes=0,
        offences=2,
    )
    third = run([(w, [], {A: WORST}) for w in (22, 23, 24)], start=second)
    assert held(third, A).until_window == 24 + 20
    assert held(third, A).offences == 3


def test_an_offender_is_remembered_after_an_accepted_update() -> None:
    standings = run([(w, [], {A: BAD}) for w in (1, 2, 3)])
    standings = run([(9, [], {A: BAD}), (10, [A], {})], start=standings)
    # Strikes cleared, the offence kept, so a repeat offence still doubles.
    assert entry(standings, A) == QuarantineEntry(
        peer_id=A,
        until_window=8,
        reason=BAD,
        strikes=0,
        offences=1,
    )
    standings = run([(w, [], {A: BAD}) for w in (11, 12, 13)], start=standings)
    assert held(standings, A).until_window == 13 + 10


def test_the_exclusion_is_capped() -> None:
    spec = ScreeningSpec(quarantine_after=1, quarantine_windows=1_000_000)
    standings = run([(5, [], {A: BAD})], spec=spec)
    assert held(standings, A).until_window == 5 + MAX_EXCLUSION
    standings = run([(50_000, [], {A: BAD})], start=standings, spec=spec)
    assert held(standings, A).until_window == 50_000 + MAX_EXCLUSION


def test_quarantine_after_one_strike() -> None:
    spec = ScreeningSpec(quarantine_after=1, quarantine_windows=2)
    standings = run([(7, [], {A: BAD})], spec=spec)
    assert entry(standings, A) == QuarantineEntry(
        peer_id=A,
        until_window=9,
        reason=BAD,
        strikes=0,
        offences=1,
    )


def test_standings_are_sorted_valid_records() -> None:
    long_reason = Reason(Code.WRONG_CODEC, ("x" * 64, "fp16"))
    standings = run(
        [
            (1, [], {C: BAD, A: long_reason, B: BAD}),
            (2, [], {C: BAD, A: long_reason}),
            (3, [B], {C: BAD, A: long_reason}),
        ]
    )
    assert [e.peer_id for e in standings] == [A, C]
    assert held(standings, A).offences == 1
    assert held(standings, C).until_window == 8
    for item in standings:
        assert isinstance(item, QuarantineEntry)
        assert decode(QuarantineEntry, encode(item), max_bytes=4096) == item
    # A head accepts them as they are (sorted, unique peer ids).
    head = Head(
        experiment_id=h("exp"),
        height=3,
        parent=h("parent"),
        weights_blob=h("w"),
        optimizer_blob=None,
        quarantine=standings,
        aggregate_blob=h("aggregate"),
    )
    assert decode(Head, encode(head), max_bytes=1 << 16) == head


def test_standings_do_not_depend_on_input_order() -> None:
    rejected_one = {A: BAD, B: WORSE, C: BAD}
    rejected_two = {C: BAD, B: WORSE, A: BAD}
    assert next_standings((), 1, [], rejected_one, SPEC) == next_standings(
        (), 1, [], rejected_two, SPEC
    )
    start = run([(1, [], {A: X, B: Y})])
    assert next_standings(reversed(start), 2, [B, A], {}, SPEC) == ()


def test_standings_are_sorted_whatever_order_they_arrive_in() -> None:
    earlier = (QuarantineEntry(peer_id=C, until_window=0, reason=X, strikes=1),)
    standings = next_standings(earlier, 2, [], {A: BAD}, SPEC)
    assert [e.peer_id for e in standings] == [A, C]
    unsorted = (held(standings, C), held(standings, A))
    assert [e.peer_id for e in next_standings(unsorted, 3, [], {}, SPEC)] == [A, C]


def test_an_entry_with_nothing_left_is_dropped_when_its_window_passes() -> None:
    """An exclusion without strikes or offences stays while it lasts, then goes."""
    excluded = QuarantineEntry(peer_id=A, until_window=5, reason=BAD)
    assert next_standings([excluded], 4, [], {}, SPEC) == (excluded,)
    assert next_standings([excluded], 5, [], {}, SPEC) == ()
    assert next_standings([excluded], 6, [B], {}, SPEC) == ()
