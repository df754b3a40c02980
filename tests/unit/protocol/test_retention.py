"""The retention rule (protocol/retention.py): which blobs a node keeps, what it deletes, and
why -- checked against hand-written keep sets."""

from __future__ import annotations

import pytest

from p2ptrain.core.manifests import WindowSpec
from p2ptrain.core.records import Head
from p2ptrain.errors import LocalError
from p2ptrain.protocol import retention as rule
from p2ptrain.protocol.retention import (
    Disposal,
    KeepSet,
    blob_verdict,
    head_blob_ids,
    keep_set,
    partial_verdict,
    pinned_blobs,
    unknown_grace_s,
    unknown_verdict,
)
from tests.support.builders import experiment, h, head, identity

EXPERIMENT = h("experiment")


def heads_up_to(top: int) -> list[Head]:
    return [head(EXPERIMENT, height, label=str(height)) for height in range(1, top + 1)]


def blobs_of(*heights: int) -> set[str]:
    return {b for n in heights for b in (h(f"weights-{n}"), h(f"opt-{n}"), h(f"aggregate-{n}"))}


def test_a_head_names_its_weights_its_optimizer_state_and_its_aggregate() -> None:
    plain = head(EXPERIMENT, 3, label="3")
    assert head_blob_ids(plain) == (h("weights-3"), h("opt-3"), h("aggregate-3"))
    no_optimizer = Head(
        experiment_id=EXPERIMENT, height=0, parent=None, weights_blob=h("g"), optimizer_blob=None
    )
    assert head_blob_ids(no_optimizer) == (h("g"),)

    def aggregated(aggregate: str) -> Head:
        return Head(
            experiment_id=EXPERIMENT,
            height=3,
            parent=h("p"),
            weights_blob=h("w"),
            optimizer_blob=h("o"),
            aggregate_blob=aggregate,
        )

    assert head_blob_ids(aggregated(h("a"))) == (h("w"), h("o"), h("a"))
    assert head_blob_ids(aggregated(h("w"))) == (h("w"), h("o"))  # named twice, listed once


def test_the_last_k_heads_are_kept_and_older_ones_released() -> None:
    keep = keep_set(height=6, keep_heads=3, heads=heads_up_to(6), pinned=[h("genesis")])
    assert keep.heads == blobs_of(4, 5, 6)
    assert keep.old_heads == blobs_of(1, 2, 3)
    assert keep.pinned == {h("genesis")}
    assert keep_set(height=6, keep_heads=1, heads=heads_up_to(6)).heads == blobs_of(6)
    # fewer heads than K (a young chain): all kept, none released
    young = keep_set(height=2, keep_heads=3, heads=heads_up_to(2))
    assert (young.heads, young.old_heads) == (blobs_of(1, 2), set())


def test_the_heads_the_roles_build_on_are_kept_whatever_their_height() -> None:
    lagging = head(EXPERIMENT, 2, label="2")  # a trainer still builds on head 2
    keep = keep_set(height=6, keep_heads=1, heads=heads_up_to(6), in_use=[lagging])
    assert keep.heads == blobs_of(2, 6)
    assert blob_verdict(h("weights-2"), keep) == Disposal(False, rule.RECENT_HEAD)
    assert blob_verdict(h("weights-3"), keep) == Disposal(True, rule.OLD_HEAD)


def test_updates_of_pending_and_recent_windows_are_kept() -> None:
    # at height 6 with UPDATE_WINDOWS_KEPT = 2: windows 5 (a peer a window behind still
    # fetches it), 6 (just certified) and 7, 8 (open, or not certified yet) are kept
    assert rule.UPDATE_WINDOWS_KEPT == 2
    updates = [(window, h(f"delta-{window}")) for window in range(1, 9)]
    keep = keep_set(height=6, keep_heads=3, heads=heads_up_to(6), updates=updates)
    assert keep.updates == {h(f"delta-{w}") for w in (5, 6, 7, 8)}
    assert keep.old_updates == {h(f"delta-{w}") for w in (1, 2, 3, 4)}
    assert blob_verdict(h("delta-7"), keep) == Disposal(False, rule.PENDING_UPDATE)
    assert blob_verdict(h("delta-4"), keep) == Disposal(True, rule.OLD_UPDATE)


def test_an_update_of_ours_still_being_pushed_is_kept_whatever_its_window() -> None:
    """An outbound-only trainer retrying its push after a partition healed: its blob of an
    old window stays until the push is done (it used to vanish under the retry)."""
    updates = [(window, h(f"delta-{window}")) for window in range(1, 9)]
    keep = keep_set(
        height=6, keep_heads=3, heads=heads_up_to(6), updates=updates, sending=[h("delta-2")]
    )
    assert blob_verdict(h("delta-2"), keep) == Disposal(False, rule.SENDING)
    assert keep.wanted(h("delta-2"))
    assert blob_verdict(h("delta-1"), keep) == Disposal(True, rule.OLD_UPDATE)


def test_what_is_kept_wins_over_what_is_released() -> None:
    keep = KeepSet(
        height=9,
        pinned=frozenset({h("genesis")}),
        heads=frozenset({h("same-weights")}),
        updates=frozenset({h("same-delta")}),
        old_heads=frozenset({h("same-weights"), h("genesis")}),
        old_updates=frozenset({h("same-delta")}),
    )
    assert blob_verdict(h("genesis"), keep) == Disposal(False, rule.PINNED)
    assert blob_verdict(h("same-weights"), keep) == Disposal(False, rule.RECENT_HEAD)
    assert blob_verdict(h("same-delta"), keep) == Disposal(False, rule.PENDING_UPDATE)
    assert blob_verdict(h("stranger"), keep) is None


def test_a_blob_nobody_named_goes_once_older_than_the_grace() -> None:
    assert unknown_verdict(9.9, 10.0) == Disposal(False, rule.YOUNG)
    assert unknown_verdict(10.0, 10.0) == Disposal(True, rule.STALE)
    # two windows' deadline and proposal slot, at least MIN_GRACE_S
    assert unknown_grace_s(WindowSpec(deadline_s=60.0, proposal_s=15.0)) == 150.0
    assert unknown_grace_s(WindowSpec(deadline_s=1.0, proposal_s=0.5)) == rule.MIN_GRACE_S


def test_genesis_and_every_dataset_shard_are_pinned() -> None:
    manifest = experiment([identity(0)], 1)
    assert pinned_blobs(manifest) == {h("genesis"), h("shard")}


@pytest.mark.parametrize(
    ("age_s", "held", "blob", "expected"),
    [
        (5.0, True, "stranger", Disposal(False, rule.YOUNG)),  # may have only just begun
        (60.0, True, "weights-6", Disposal(True, rule.DOWNLOADED)),
        (60.0, False, "stranger", Disposal(True, rule.UNWANTED)),
        (60.0, False, "weights-2", Disposal(True, rule.UNWANTED)),  # an old head's
        (60.0, False, "weights-6", Disposal(False, rule.RESUMABLE)),
        (60.0, False, "genesis", Disposal(False, rule.RESUMABLE)),
        (7200.0, False, "weights-6", Disposal(True, rule.ABANDONED)),
    ],
)
def test_partial_downloads(age_s: float, held: bool, blob: str, expected: Disposal) -> None:
    keep = keep_set(height=6, keep_heads=1, heads=heads_up_to(6), pinned=[h("genesis")])
    verdict = partial_verdict(h(blob), age_s, held=held, keep=keep, grace_s=10.0)
    assert verdict == expected


def test_at_least_one_head_is_kept() -> None:
    with pytest.raises(LocalError, match="at least the last head"):
        keep_set(height=3, keep_heads=0, heads=heads_up_to(3))
