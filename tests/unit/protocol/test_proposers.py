"""Who proposes a window's head, in which order, and when each slot opens."""

from __future__ import annotations

import hashlib

import msgspec

from p2ptrain.core.manifests import WindowSpec
from p2ptrain.protocol.proposers import proposer_order, slot_at, slot_start
from tests.support.builders import experiment, identity

VALIDATORS = [identity(i).public_key for i in range(4)]
REDUCERS = [identity(50 + i).public_key for i in range(6)]
MANIFEST = msgspec.structs.replace(
    experiment([identity(i) for i in range(4)], quorum=3),
    window=WindowSpec(deadline_s=60.0, proposal_s=15.0),
)
EXPERIMENT_ID = MANIFEST.id


def ranked(window: int, keys: list[bytes]) -> list[bytes]:
    """The documented ranking: ascending SHA-256("p2ptrain/v1/proposer" 0 exp 0 w 0 key)."""

    def score(key: bytes) -> bytes:
        parts = [b"p2ptrain/v1/proposer", EXPERIMENT_ID.encode(), str(window).encode(), key]
        return hashlib.sha256(b"\0".join(parts)).digest()

    return sorted(keys, key=score)


def test_ranked_reducers_come_first_then_ranked_validators() -> None:
    for window in (1, 2, 17):
        order = proposer_order(MANIFEST, EXPERIMENT_ID, window, REDUCERS)
        assert len(order) == len(REDUCERS) + len(VALIDATORS)
        assert set(order[: len(REDUCERS)]) == set(REDUCERS)
        assert set(order[len(REDUCERS) :]) == set(VALIDATORS)
        assert list(order) == ranked(window, REDUCERS) + ranked(window, VALIDATORS)


def test_without_reducers_the_validators_propose() -> None:
    order = proposer_order(MANIFEST, EXPERIMENT_ID, 3, [])
    assert list(order) == ranked(3, VALIDATORS)


def test_the_order_is_deterministic_and_ignores_how_reducers_are_listed() -> None:
    order = proposer_order(MANIFEST, EXPERIMENT_ID, 5, REDUCERS)
    assert proposer_order(MANIFEST, EXPERIMENT_ID, 5, REDUCERS) == order
    assert proposer_order(MANIFEST, EXPERIMENT_ID, 5, list(reversed(REDUCERS))) == order
    assert proposer_order(MANIFEST, EXPERIMENT_ID, 5, REDUCERS + REDUCERS[:2]) == order
    assert proposer_order(MANIFEST, EXPERIMENT_ID, 5, iter(REDUCERS)) == order


def test_the_order_varies_across_windows() -> None:
    orders = [proposer_order(MANIFEST, EXPERIMENT_ID, w, REDUCERS) for w in range(1, 31)]
    assert len(set(orders)) >= 20
    # Every reducer leads some window, and so does every validator among the fallbacks.
    assert {order[0] for order in orders} == set(REDUCERS)
    assert {order[len(REDUCERS)] for order in orders} == set(VALIDATORS)


def test_the_order_depends_on_the_experiment() -> None:
    other = msgspec.structs.replace(MANIFEST, name="other").id
    orders = [proposer_order(MANIFEST, EXPERIMENT_ID, w, REDUCERS) for w in range(1, 11)]
    others = [proposer_order(MANIFEST, other, w, REDUCERS) for w in range(1, 11)]
    assert orders != others


def test_dropped_reducers_are_left_out() -> None:
    dropped = REDUCERS[1:3]
    order = proposer_order(MANIFEST, EXPERIMENT_ID, 4, REDUCERS, dropped=dropped)
    assert len(order) == len(REDUCERS) - 2 + len(VALIDATORS)
    assert not set(dropped) & set(order)
    kept = [key for key in REDUCERS if key not in dropped]
    assert list(order) == ranked(4, kept) + ranked(4, VALIDATORS)


def test_validators_listed_as_reducers_propose_only_as_validators() -> None:
    reducers = REDUCERS + VALIDATORS[:2]
    order = proposer_order(MANIFEST, EXPERIMENT_ID, 4, reducers)
    assert len(order) == len(set(order)) == len(REDUCERS) + len(VALIDATORS)
    assert set(order[: len(REDUCERS)]) == set(REDUCERS)
    assert list(order) == ranked(4, REDUCERS) + ranked(4, VALIDATORS)


def test_dropping_a_validator_does_not_remove_its_fallback_slot() -> None:
    order = proposer_order(MANIFEST, EXPERIMENT_ID, 4, REDUCERS, dropped=VALIDATORS[:1])
    assert VALIDATORS[0] in order[len(REDUCERS) :]


def test_slots_follow_the_close_one_proposal_slot_apart() -> None:
    assert slot_start(MANIFEST, 1060.0, 0) == 1060.0
    assert slot_start(MANIFEST, 1060.0, 1) == 1075.0
    assert slot_start(MANIFEST, 1060.0, 9) == 1060.0 + 9 * 15.0
    fast = msgspec.structs.replace(MANIFEST, window=WindowSpec(deadline_s=2.5, proposal_s=0.5))
    assert slot_start(fast, 12.5, 3) == 14.0


def test_the_slot_at_a_time_is_minus_one_before_the_close_and_counts_on_after() -> None:
    assert slot_at(MANIFEST, 1060.0, 1059.9) == -1
    assert slot_at(MANIFEST, 1060.0, 1060.0) == 0
    assert slot_at(MANIFEST, 1060.0, 1074.9) == 0
    for index in range(40):  # a boundary computed by slot_start opens its slot
        assert slot_at(MANIFEST, 1060.0, slot_start(MANIFEST, 1060.0, index)) == index
