"""The peer book: which signed record wins, which are refused, and strikes and bans on an
injected clock."""

from __future__ import annotations

import functools
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.core.envelope import Signed
from p2ptrain.core.records import PeerRecord
from p2ptrain.errors import ProtocolViolation
from p2ptrain.net import peers
from p2ptrain.net.peers import PeerBook, PeerBookStatistics
from tests.support.builders import h, identity, peer_record

NETWORK_ID = h("network")
OTHER_NETWORK_ID = h("other network")
ME = identity(10)
ALICE = identity(20)
BOB = identity(21)


@functools.cache
def record(n: int, seq: int, network_id: str = NETWORK_ID, port: int = 7000) -> Signed[PeerRecord]:
    """Peer ``identity(n)``'s record number ``seq``."""
    return peer_record(identity(n), seq, network_id=network_id, address=f"http://10.0.0.{n}:{port}")


def book(strikes_to_ban: int = 3, ban_s: float = 300.0) -> PeerBook:
    return PeerBook(NETWORK_ID, self_id=ME.peer_id, strikes_to_ban=strikes_to_ban, ban_s=ban_s)


# -- records --------------------------------------------------------------------------------


def test_a_new_record_is_kept() -> None:
    peers_ = book()
    assert peers_.get(ALICE.peer_id) is None
    assert peers_.add(record(20, 1)) is True
    assert peers_.get(ALICE.peer_id) == record(20, 1)
    assert len(peers_) == 1
    assert list(peers_) == [record(20, 1)]


def test_a_higher_seq_replaces_and_a_lower_or_equal_one_is_ignored() -> None:
    peers_ = book()
    assert peers_.add(record(20, 5))
    assert peers_.add(record(20, 6)) is True
    assert peers_.get(ALICE.peer_id) == record(20, 6)
    assert peers_.add(record(20, 4)) is False
    # Same seq, different content: the record held first stays.
    assert peers_.add(record(20, 6, port=9999)) is False
    assert peers_.get(ALICE.peer_id) == record(20, 6)
    assert peers_.add(record(20, 6)) is False
    assert len(peers_) == 1
    assert peers_.statistics().records_rejected == 0


def test_records_are_kept_per_peer() -> None:
    peers_ = book()
    assert peers_.add(record(20, 9))
    assert peers_.add(record(21, 1))  # a lower seq of another peer is news
    assert peers_.get(BOB.peer_id) == record(21, 1)
    assert {s.record.peer_id for s in peers_} == {ALICE.peer_id, BOB.peer_id}


def test_a_record_for_another_network_is_a_protocol_violation_and_counted() -> None:
    peers_ = book()
    for n in (1, 2):
        with pytest.raises(ProtocolViolation, match="another network"):
            peers_.add(record(20, n, network_id=OTHER_NETWORK_ID))
        assert peers_.statistics().records_rejected == n
    assert len(peers_) == 0
    assert peers_.get(ALICE.peer_id) is None


def test_our_own_record_is_ignored() -> None:
    peers_ = book()
    assert peers_.add(record(10, 1)) is False
    assert peers_.get(ME.peer_id) is None
    assert len(peers_) == 0
    assert peers_.statistics().records_rejected == 0


def test_a_full_book_keeps_updating_known_peers_but_takes_no_new_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(peers, "MAX_PEERS", 2)
    peers_ = book()
    assert peers_.add(record(20, 1))
    assert peers_.add(record(21, 1))
    assert peers_.add(record(22, 1)) is False
    assert len(peers_) == 2
    assert peers_.add(record(21, 2)) is True
    assert peers_.get(BOB.peer_id) == record(21, 2)


def test_iterating_is_safe_while_the_book_changes() -> None:
    peers_ = book()
    peers_.add(record(20, 1))
    peers_.add(record(21, 1))
    seen = []
    for signed in peers_:
        seen.append(signed.record.peer_id)
        peers_.add(record(22, 1))
    assert len(seen) == 2
    assert len(peers_) == 3


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from([10, 20, 21, 22]), st.integers(0, 6)), max_size=30))
def test_the_book_holds_each_peer_s_highest_seq(adds: list[tuple[int, int]]) -> None:
    peers_ = book()
    highest: dict[int, int] = {}
    for n, seq in adds:
        news = n != 10 and (n not in highest or seq > highest[n])
        assert peers_.add(record(n, seq)) is news
        if news:
            highest[n] = seq
    assert len(peers_) == len(highest)
    for n, seq in highest.items():
        held = peers_.get(identity(n).peer_id)
        assert held is not None and held.record.seq == seq


# -- strikes and bans -----------------------------------------------------------------------


def test_strikes_ban_at_the_threshold_for_ban_s() -> None:
    peers_ = book(strikes_to_ban=3, ban_s=300.0)
    who = ALICE.peer_id
    assert peers_.strike(who, "bad frame", now=0.0) is False
    assert peers_.strike(who, "bad frame", now=1.0) is False
    assert peers_.banned(who, now=1.0) is False
    assert peers_.strike(who, "bad frame", now=2.0) is True
    assert peers_.banned(who, now=2.0) is True
    assert peers_.banned(who, now=301.9) is True
    assert peers_.banned(who, now=302.0) is False  # banned until 2 + 300, exclusive
    assert peers_.banned(who, now=2.0) is False  # an expired ban is forgotten


def test_a_ban_resets_the_strike_count() -> None:
    peers_ = book(strikes_to_ban=2, ban_s=10.0)
    who = "10.0.0.1"  # strikes are kept per peer id or remote address
    assert peers_.strike(who, "x", 0.0) is False
    assert peers_.strike(who, "x", 0.0) is True
    assert peers_.banned(who, 10.0) is False
    assert peers_.strike(who, "x", 20.0) is False  # counting starts over
    assert peers_.banned(who, 20.0) is False
    assert peers_.strike(who, "x", 21.0) is True
    assert peers_.banned(who, 30.0) is True


def test_strikes_are_counted_per_offender() -> None:
    peers_ = book(strikes_to_ban=2)
    assert peers_.strike(ALICE.peer_id, "x", 0.0) is False
    assert peers_.strike(BOB.peer_id, "x", 0.0) is False
    assert peers_.banned(ALICE.peer_id, 0.0) is False
    assert peers_.strike(BOB.peer_id, "x", 0.0) is True
    assert peers_.banned(BOB.peer_id, 0.0) is True
    assert peers_.banned(ALICE.peer_id, 0.0) is False


def test_one_strike_bans_when_the_threshold_is_one() -> None:
    peers_ = book(strikes_to_ban=1, ban_s=5.0)
    assert peers_.strike(ALICE.peer_id, "x", 100.0) is True
    assert peers_.banned(ALICE.peer_id, 104.5)
    assert not peers_.banned(ALICE.peer_id, 105.0)


def test_an_explicit_ban_lasts_ban_s() -> None:
    peers_ = book(ban_s=60.0)
    assert peers_.banned(ALICE.peer_id, 0.0) is False
    peers_.ban(ALICE.peer_id, "sent a forged certificate", 50.0)
    assert peers_.banned(ALICE.peer_id, 50.0)
    assert peers_.banned(ALICE.peer_id, 109.0)
    assert not peers_.banned(ALICE.peer_id, 110.0)
    # A ban does not touch the records held.
    assert peers_.add(record(20, 1))


def test_a_zero_ban_bans_nobody() -> None:
    peers_ = book(strikes_to_ban=1, ban_s=0.0)
    assert peers_.strike(ALICE.peer_id, "x", 7.0) is True
    assert peers_.banned(ALICE.peer_id, 7.0) is False


def test_strikes_and_bans_are_logged_with_their_reason(caplog: pytest.LogCaptureFixture) -> None:
    peers_ = book(strikes_to_ban=2, ban_s=30.0)
    with caplog.at_level(logging.WARNING, logger="p2ptrain.net.peers"):
        peers_.strike(ALICE.peer_id, "undecodable frame", 0.0)
        peers_.strike(ALICE.peer_id, "undecodable frame", 0.0)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == f"peer {ALICE.peer_id[:16]}: undecodable frame (strike 1 of 2)"
    assert messages[1] == f"peer {ALICE.peer_id[:16]}: undecodable frame (strike 2 of 2)"
    assert messages[2] == f"peer {ALICE.peer_id[:16]} banned for 30 s"


# -- statistics -----------------------------------------------------------------------------


def test_statistics_count_peers_bans_strikes_and_rejections() -> None:
    peers_ = book(strikes_to_ban=2, ban_s=100.0)
    assert peers_.statistics() == PeerBookStatistics(
        peers=0, banned=0, strikes=0, records_rejected=0
    )
    peers_.add(record(20, 1))
    peers_.add(record(21, 1))
    peers_.add(record(21, 2))  # a replacement, not another peer
    with pytest.raises(ProtocolViolation):
        peers_.add(record(22, 1, network_id=OTHER_NETWORK_ID))
    peers_.strike(ALICE.peer_id, "x", 0.0)
    peers_.strike(BOB.peer_id, "x", 0.0)
    peers_.strike(BOB.peer_id, "x", 0.0)  # bans bob
    peers_.ban("10.0.0.9", "flooding", 50.0)
    assert peers_.statistics() == PeerBookStatistics(
        peers=2, banned=2, strikes=3, records_rejected=1
    )
    # Bob's ban is over and forgotten once found so; strikes are a running total.
    assert not peers_.banned(BOB.peer_id, 100.0)
    assert peers_.statistics() == PeerBookStatistics(
        peers=2, banned=1, strikes=3, records_rejected=1
    )


def test_statistics_are_a_frozen_snapshot() -> None:
    peers_ = book()
    snapshot = peers_.statistics()
    peers_.add(record(20, 1))
    assert snapshot.peers == 0
    assert peers_.statistics().peers == 1
    with pytest.raises(AttributeError):
        snapshot.peers = 5  # type: ignore[misc]


def test_strikes_lapse_after_the_decay_time() -> None:
    peers_ = PeerBook(
        NETWORK_ID, self_id=ME.peer_id, strikes_to_ban=3, ban_s=300.0, strike_decay_s=100.0
    )
    who = ALICE.peer_id
    assert peers_.strike(who, "bad frame", now=0.0) is False
    assert peers_.strike(who, "bad frame", now=50.0) is False
    assert peers_.strikes(who, 99.0) == 2
    assert peers_.strikes(who, 100.0) == 1  # the first lapsed
    assert peers_.strike(who, "bad frame", now=120.0) is False  # 2 live, not 3
    assert peers_.strikes(who, 149.0) == 2
    assert peers_.strike(who, "bad frame", now=149.0) is True  # 50, 120 and 149
    assert peers_.banned(who, 149.0)


def test_a_lifetime_of_rare_strikes_never_bans() -> None:
    peers_ = PeerBook(
        NETWORK_ID, self_id=ME.peer_id, strikes_to_ban=3, ban_s=300.0, strike_decay_s=600.0
    )
    for hour in range(1000):
        assert peers_.strike(ALICE.peer_id, "a rare mistake", now=hour * 3600.0) is False
    assert not peers_.banned(ALICE.peer_id, 1000 * 3600.0)
