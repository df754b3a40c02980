"""Bounds on what a peer can make a node do: token buckets, the gossip seen-set, and the
range checks of the network settings that size them."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.errors import LocalError
from p2ptrain.net.config import NetConfig
from p2ptrain.net.limits import SeenSet, TokenBucket

# -- TokenBucket ----------------------------------------------------------------------------
# Rates, amounts and times are chosen so every value is exact in binary floating point.


def test_a_new_bucket_holds_its_burst() -> None:
    bucket = TokenBucket(rate=4.0, burst=8.0, now=0.0)
    assert bucket.take(8, 0.0) == 0.0  # 8 - 8 = 0 tokens: covered exactly
    assert bucket.take(2, 0.0) == 0.5  # -2 tokens at 4/s: wait 0.5 s


def test_the_bucket_refills_at_its_rate() -> None:
    bucket = TokenBucket(rate=4.0, burst=8.0, now=10.0)
    assert bucket.take(8, 10.0) == 0.0  # empty
    assert bucket.take(1, 10.25) == 0.0  # +1 token after 0.25 s, spent: 0 left
    assert bucket.take(3, 10.75) == 0.25  # +2 tokens, 3 spent: -1 token, 0.25 s at 4/s
    assert bucket.take(0, 10.75) == 0.25  # the debt is still owed
    assert bucket.take(0, 11.0) == 0.0  # +1 token: even
    assert bucket.take(1, 11.5) == 0.0  # +2 tokens, 1 spent: 1 left
    assert bucket.take(2, 11.5) == 0.25  # 1 - 2 = -1


def test_refill_stops_at_the_burst() -> None:
    bucket = TokenBucket(rate=4.0, burst=8.0, now=0.0)
    assert bucket.take(8, 0.0) == 0.0
    # 100 s at 4/s would be 400 tokens; the bucket holds at most 8.
    assert bucket.take(10, 100.0) == 0.5  # 8 - 10 = -2 tokens: 0.5 s


def test_a_large_take_runs_into_debt_instead_of_starving() -> None:
    bucket = TokenBucket(rate=4.0, burst=8.0, now=0.0)
    assert bucket.take(20, 0.0) == 3.0  # 8 - 20 = -12 tokens: 3 s at 4/s
    assert bucket.take(0, 1.0) == 2.0  # -12 + 4 = -8 tokens: 2 s more
    assert bucket.take(0, 3.0) == 0.0  # -8 + 8 = 0: paid off
    assert bucket.take(1, 3.0) == 0.25  # nothing in hand again


def test_a_slow_bucket_waits_seconds_per_token() -> None:
    bucket = TokenBucket(rate=0.5, burst=1.0, now=0.0)
    assert bucket.take(1, 0.0) == 0.0
    assert bucket.take(1, 0.0) == 2.0  # one token at 0.5/s
    assert bucket.take(1, 0.0) == 4.0  # two tokens owed


def test_taking_nothing_never_asks_to_wait_from_a_full_bucket() -> None:
    bucket = TokenBucket(rate=1.0, burst=1.0, now=0.0)
    assert bucket.take(0, 0.0) == 0.0
    assert bucket.take(0, 1e9) == 0.0


@settings(max_examples=500)
@given(
    st.floats(0.01, 1e6),
    st.floats(1, 1e6),
    st.lists(st.tuples(st.floats(0, 1e6), st.floats(0, 100)), min_size=1, max_size=20),
)
def test_waiting_the_time_asked_pays_off_the_debt(
    rate: float, burst: float, steps: list[tuple[float, float]]
) -> None:
    """Whatever was taken before, after waiting the seconds ``take`` returned, a take of
    nothing asks for (almost) no more wait, and the bucket never holds more than its burst."""
    bucket = TokenBucket(rate, burst, now=0.0)
    now = 0.0
    for amount, gap in steps:
        now += gap
        wait = bucket.take(amount, now)
        assert wait >= 0.0
        # abs_tol: a debt of a subnormal number of tokens loses its precision when divided
        # by the rate (hypothesis found amount 2.2e-313 at rate 107); nobody waits 1e-315 s
        assert wait == 0.0 or math.isclose(
            wait * rate, -bucket._tokens, rel_tol=1e-9, abs_tol=1e-12
        )
        assert bucket._tokens <= burst
    later = bucket.take(0, now + wait)
    assert later <= 1e-6 * max(1.0, wait)


# -- SeenSet --------------------------------------------------------------------------------


def test_a_second_add_of_the_same_id_is_a_duplicate() -> None:
    seen = SeenSet(capacity=4, ttl=60.0)
    assert seen.add(b"a", 0.0) is True
    assert seen.add(b"a", 1.0) is False
    assert seen.add(b"b", 1.0) is True
    assert b"a" in seen and b"b" in seen and b"c" not in seen
    assert len(seen) == 2


def test_the_oldest_id_is_evicted_when_full() -> None:
    seen = SeenSet(capacity=3, ttl=1000.0)
    for t, message in enumerate([b"a", b"b", b"c"]):
        assert seen.add(message, float(t))
    assert len(seen) == 3
    assert seen.add(b"d", 3.0)
    assert len(seen) == 3
    assert b"a" not in seen
    assert [m in seen for m in (b"b", b"c", b"d")] == [True, True, True]
    # A duplicate does not refresh its place: b is still the oldest and goes next.
    assert seen.add(b"b", 4.0) is False
    assert seen.add(b"e", 5.0)
    assert b"b" not in seen and b"c" in seen
    # An evicted id is news again.
    assert seen.add(b"a", 6.0) is True
    assert b"c" not in seen
    assert len(seen) == 3


def test_ids_older_than_the_ttl_are_evicted_on_the_next_add() -> None:
    seen = SeenSet(capacity=100, ttl=10.0)
    assert seen.add(b"a", 0.0)
    assert seen.add(b"b", 5.0)
    assert seen.add(b"c", 10.0)  # a is exactly 10 s old: kept
    assert b"a" in seen
    assert seen.add(b"d", 10.5)  # a is 10.5 s old: gone; b is 5.5 s old: kept
    assert b"a" not in seen and b"b" in seen
    assert seen.add(b"e", 15.5)  # b is 10.5 s old: gone
    assert b"b" not in seen
    assert len(seen) == 3  # c, d, e


def test_one_late_add_evicts_every_expired_id() -> None:
    seen = SeenSet(capacity=100, ttl=10.0)
    for t in range(5):
        seen.add(bytes([t]), float(t))
    assert seen.add(b"late", 100.0)
    assert len(seen) == 1
    assert b"late" in seen


def test_a_capacity_of_one_keeps_only_the_latest() -> None:
    seen = SeenSet(capacity=1, ttl=10.0)
    assert seen.add(b"a", 0.0)
    assert seen.add(b"b", 0.0)
    assert b"a" not in seen and b"b" in seen
    assert len(seen) == 1


def test_an_id_seen_longer_ago_than_the_ttl_is_news_again() -> None:
    seen = SeenSet(capacity=100, ttl=10.0)
    assert seen.add(b"a", 0.0)
    # 1000 s later the id is far older than the ttl, as if another message had evicted it.
    assert seen.add(b"a", 1000.0) is True


@settings(max_examples=300)
@given(
    st.integers(1, 8),
    st.floats(0.5, 20),
    st.lists(st.tuples(st.integers(0, 12), st.floats(0, 5)), max_size=60),
)
def test_the_seen_set_matches_a_model(
    capacity: int, ttl: float, steps: list[tuple[int, float]]
) -> None:
    """A list model of the same rules: insertion order, at most ``capacity``, and nothing
    older than ``ttl`` after any add (an id older than ``ttl`` is news again)."""
    seen = SeenSet(capacity, ttl)
    model: list[tuple[bytes, float]] = []
    now = 0.0
    for n, gap in steps:
        now += gap
        message = bytes([n])
        model = [(m, stamp) for m, stamp in model if stamp >= now - ttl]
        fresh = message not in dict(model)
        assert seen.add(message, now) is fresh
        if fresh:
            model.append((message, now))
            if len(model) > capacity:
                model.pop(0)
        assert len(seen) == len(model) <= capacity
        assert all(m in seen for m, _ in model)


# -- NetConfig ------------------------------------------------------------------------------


def test_the_default_settings_are_valid() -> None:
    config = NetConfig()
    assert config.strikes_to_ban == 3
    assert config.byte_burst >= config.max_frame_bytes
    assert config.seen_entries == 1_000_000


@pytest.mark.parametrize(
    ("name", "bad", "edge"),
    [
        ("port", 65536, 65535),
        ("port", -1, 0),
        ("max_outbound", 1025, 1024),
        ("max_inbound", 4097, 4096),
        ("max_frame_bytes", 4095, 4096),
        ("frames_per_s", 0.5, 1.0),
        ("frame_burst", 0, 1),
        ("bytes_per_s", 1023.0, 1024.0),
        ("requests_per_s", 0.0, 1.0),
        ("request_burst", 0, 1),
        ("flood_tolerance_s", -0.1, 0.0),
        ("send_queue_frames", 15, 16),
        ("seen_entries", 1023, 1024),
        ("seen_ttl_s", 0.5, 1.0),
        ("strikes_to_ban", 0, 1),
        ("ban_s", -1.0, 0.0),
        ("connect_timeout_s", 0.0, 0.01),
        ("request_timeout_s", 3601.0, 3600.0),
        ("handshake_timeout_s", 61.0, 60.0),
        ("discovery_interval_s", 0.001, 0.01),
        ("seen_ttl_s", math.nan, 600.0),
    ],
)
def test_settings_out_of_range_are_a_local_error_naming_the_setting(
    name: str, bad: float, edge: float
) -> None:
    edge_settings: dict[str, Any] = {name: edge}
    bad_settings: dict[str, Any] = {name: bad}
    assert getattr(NetConfig(**edge_settings), name) == edge
    with pytest.raises(LocalError, match=f"{name}=") as caught:
        NetConfig(**bad_settings)
    assert "out of range" in str(caught.value)


def test_the_byte_burst_must_hold_one_whole_frame() -> None:
    assert NetConfig(max_frame_bytes=1 << 16, byte_burst=1 << 16).byte_burst == 1 << 16
    with pytest.raises(LocalError, match="byte_burst"):
        NetConfig(max_frame_bytes=1 << 16, byte_burst=(1 << 16) - 1)


def test_a_node_without_a_server_cannot_serve_tls() -> None:
    assert NetConfig(host=None).host is None
    with pytest.raises(LocalError, match="TLS"):
        NetConfig(host=None, tls=True)


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        NetConfig().port = 1  # type: ignore[misc]
