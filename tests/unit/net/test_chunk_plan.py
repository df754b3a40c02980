"""The pure parts of blob transfer: chunk planning with failover and resume, and finding the
provider that served bad bytes (proof, not suspicion); plus BlobStore.adopt_verified and
the partial downloads a fetch leaves on disk."""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2ptrain.errors import LocalError
from p2ptrain.net.chunk_plan import ChunkPlan, Piece, Reconciliation, Span
from p2ptrain.net.partial_file import partial_downloads, remove_partial
from p2ptrain.store.blobs import BlobStore

A, B, C = "http://a", "http://b", "http://c"

# -- ChunkPlan ----------------------------------------------------------------------------


def test_chunks_go_out_lowest_first_and_the_last_one_is_short() -> None:
    plan = ChunkPlan(25, 10, [A, B])
    assert plan.next_span(A) == Span(0, 0, 10)
    assert plan.next_span(B) == Span(1, 10, 20)
    assert plan.next_span(A) == Span(2, 20, 25)
    assert plan.next_span(B) is None  # all in flight
    assert (plan.frontier, plan.complete) == (0, False)


def test_a_ramp_of_growing_chunks_makes_streams_started_together_finish_in_order() -> None:
    plan = ChunkPlan(100, 12, [A, B, C], ramp=3)
    spans = [plan.next_span(p) for p in (A, B, C)]
    assert spans == [Span(0, 0, 4), Span(1, 4, 12), Span(2, 12, 24)]
    assert plan.next_span(A) == Span(3, 24, 36)  # then full chunks
    # At one rate, each stream is done after its chunk's length: in chunk order.
    assert sorted(spans, key=lambda s: s.end - s.start) == spans
    ends = [plan.chunk_end(i) for i in range(3, 10)]
    assert ends == [36, 48, 60, 72, 84, 96, 100]


def test_the_frontier_is_the_contiguous_prefix_on_disk() -> None:
    plan = ChunkPlan(30, 10, [A, B])
    first, second = plan.next_span(A), plan.next_span(B)
    assert first is not None and second is not None
    assert plan.received(1, B, 10) is True  # out of order: the frontier stays put
    assert plan.frontier == 0
    assert plan.received(0, A, 4) is False
    assert plan.frontier == 4  # the frontier chunk's bytes count as they land
    assert plan.received(0, A, 6) is True
    assert plan.frontier == 20
    third = plan.next_span(A)
    assert third == Span(2, 20, 30)
    plan.received(2, A, 10)
    assert (plan.frontier, plan.complete) == (30, True)
    assert plan.pieces() == [Piece(0, 10, A), Piece(10, 20, B), Piece(20, 30, A)]


def test_a_failed_chunk_continues_from_the_byte_reached_at_another_provider() -> None:
    plan = ChunkPlan(20, 10, [A, B])
    assert plan.next_span(A) == Span(0, 0, 10)
    plan.received(0, A, 3)
    assert plan.failed(0, A, "connection reset") is False  # one failure does not drop A
    # A failed chunk 0, so A gets the next chunk; B takes chunk 0 from byte 3.
    assert plan.next_span(A) == Span(1, 10, 20)
    assert plan.next_span(B) == Span(0, 3, 10)
    plan.received(0, B, 7)
    assert plan.pieces() == [Piece(0, 3, A), Piece(3, 10, B)]
    assert plan.frontier == 10


def test_a_provider_gets_a_chunk_it_failed_again_only_when_everyone_failed_it() -> None:
    plan = ChunkPlan(10, 10, [A, B])
    plan.next_span(A)
    plan.failed(0, A, "timeout")
    assert plan.next_span(A) is None  # B has not tried chunk 0 yet
    plan.next_span(B)
    plan.failed(0, B, "timeout")
    assert plan.next_span(A) == Span(0, 0, 10)


def test_providers_are_dropped_after_max_failures_or_at_once_when_fatal() -> None:
    plan = ChunkPlan(40, 10, [A, B, C], max_failures=2)
    plan.next_span(A)
    assert plan.failed(0, A, "reset") is False
    plan.next_span(A)
    assert plan.failed(1, A, "reset again") is True
    assert plan.dropped == {A: "reset again"}
    assert plan.next_span(A) is None
    plan.next_span(B)
    assert plan.failed(0, B, "404", fatal=True) is True
    assert plan.live == [C]
    stalled_before = plan.stalled
    plan.next_span(C)
    plan.failed(0, C, "gone", fatal=True)
    assert (stalled_before, plan.stalled) == (False, True)
    assert plan.completed_ranges() == []


def test_resume_keeps_chunk_prefixes_on_disk_and_refetches_the_rest() -> None:
    # [0, 15) covers chunk 0 and half of chunk 1; [25, 40) starts inside chunk 2 (ignored)
    # and covers chunk 3.
    plan = ChunkPlan(45, 10, [A], completed=[(0, 15), (25, 40)])
    assert plan.resumed_bytes == 10 + 5 + 10
    assert plan.frontier == 15
    assert plan.next_span(A) == Span(1, 15, 20)
    assert plan.next_span(A) == Span(2, 20, 30)
    assert plan.next_span(A) == Span(4, 40, 45)
    assert plan.completed_ranges() == [(0, 15), (30, 40)]
    assert plan.pieces() == [Piece(0, 10, None), Piece(10, 15, None), Piece(30, 40, None)]


def test_an_empty_blob_is_complete_at_once_and_bad_settings_are_local_errors() -> None:
    plan = ChunkPlan(0, 10, [A])
    assert plan.complete and plan.frontier == 0 and plan.next_span(A) is None
    with pytest.raises(LocalError):
        ChunkPlan(10, 0, [A])


@given(st.data())
def test_random_schedules_keep_the_plan_consistent(data: st.DataObject) -> None:
    """Any interleaving of partial receipts and failures: no chunk is in flight twice, the
    pieces cover exactly the completed ranges, the frontier is their contiguous prefix, and
    the plan completes when a provider stays healthy."""
    size = data.draw(st.integers(1, 200), label="size")
    chunk = data.draw(st.integers(1, 50), label="chunk")
    ramp = data.draw(st.integers(1, 6), label="ramp")
    providers = [A, B, C]
    plan = ChunkPlan(size, chunk, providers, max_failures=10**6, ramp=ramp)
    in_flight: dict[str, Span] = {}
    for _ in range(1000):
        if plan.complete:
            break
        provider = data.draw(st.sampled_from(providers))
        span = in_flight.get(provider) or plan.next_span(provider)
        if span is None:
            continue
        assert all(other.chunk != span.chunk for p, other in in_flight.items() if p != provider)
        in_flight[provider] = span
        if provider != A and data.draw(st.booleans()):
            plan.failed(span.chunk, provider, "flaky")
            del in_flight[provider]
            continue
        count = data.draw(st.integers(1, span.end - span.start))
        done = plan.received(span.chunk, provider, count)
        remaining = Span(span.chunk, span.start + count, span.end)
        if done:
            del in_flight[provider]
        else:
            in_flight[provider] = remaining
        ranges = plan.completed_ranges()
        covered = sorted((p.start, p.end) for p in plan.pieces())
        assert sum(e - s for s, e in covered) == sum(e - s for s, e in ranges)
        assert plan.frontier == (ranges[0][1] if ranges and ranges[0][0] == 0 else 0)
    while not plan.complete:  # A alone finishes whatever is left
        for provider, span in list(in_flight.items()):
            plan.failed(span.chunk, provider, "give up")
            del in_flight[provider]
        span = plan.next_span(A)
        assert span is not None
        plan.received(span.chunk, A, span.end - span.start)
    assert plan.completed_ranges() == [(0, size)]
    assert sum(p.end - p.start for p in plan.pieces()) == size


# -- Reconciliation -----------------------------------------------------------------------


def digest(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def run_reconciliation(
    served: Sequence[str | None],
    truth: list[str],
    lies: dict[str, dict[int, str]],
    live: list[str],
) -> tuple[dict[str, Piece] | None, int]:
    """Drive a reconciliation the way the fetcher does. ``served[i]`` served piece i with
    its version (``lies[p][i]`` or the truth); returns the blame (None: nothing verified)
    and the rounds of re-fetching it took."""

    def version(provider: str | None, piece: int) -> str:
        return lies.get(provider or "", {}).get(piece, truth[piece])

    if all(version(p, i) == truth[i] for i, p in enumerate(served)):
        return {}, 0  # the blob verified: the fetcher never reconciles
    pieces = [Piece(i, i + 1, p) for i, p in enumerate(served)]
    reconciliation = Reconciliation(pieces, [digest(version(p, i)) for i, p in enumerate(served)])
    rounds = 0
    while True:
        for choice in reconciliation.candidates():
            reconciliation.tried(choice)
            assembled = [reconciliation.digest_of(i, v) for i, v in enumerate(choice)]
            if assembled == [digest(t) for t in truth]:
                return reconciliation.blame(choice), rounds
        plan = reconciliation.refetch_plan(live)
        if not plan:
            return None, rounds
        rounds += 1
        for piece, provider in plan.items():
            reconciliation.add(piece, provider, digest(version(provider, piece)), rounds)


def test_one_liar_among_three_is_found_in_one_round_and_blamed_alone() -> None:
    truth = ["t0", "t1", "t2"]
    blame, rounds = run_reconciliation([A, B, C], truth, {B: {0: "x", 1: "x", 2: "x"}}, [A, B, C])
    assert blame == {B: Piece(0, 1, B)}  # B re-served piece 0, and lied there too
    assert rounds == 1


def test_with_two_providers_one_liar_is_still_proven() -> None:
    truth = ["t0", "t1", "t2", "t3"]
    lies = {B: {1: "x", 3: "y"}}
    blame, _ = run_reconciliation([A, B, A, B], truth, lies, [A, B])
    assert blame == {B: Piece(1, 2, B)}


def test_when_every_provider_lies_the_same_way_nobody_is_blamed() -> None:
    truth = ["t0", "t1"]
    lies = {A: {0: "x"}, B: {0: "x"}}
    blame, rounds = run_reconciliation([A, B], truth, lies, [A, B])
    assert blame is None
    assert rounds == 1  # each piece asked of the other provider, then nobody is left


def test_bytes_from_an_earlier_fetch_are_replaced_without_blaming_anyone() -> None:
    truth = ["t0", "t1"]
    blame, _ = run_reconciliation([None, A], truth, {"": {0: "zeros"}}, [A])
    assert blame == {}


def test_refetch_spreads_contested_pieces_and_never_asks_twice() -> None:
    pieces = [Piece(0, 1, A), Piece(1, 2, A), Piece(2, 3, B)]
    reconciliation = Reconciliation(pieces, [digest("a"), digest("b"), digest("c")])
    assert reconciliation.refetch_plan([A, B, C]) == {0: B, 1: C, 2: A}
    reconciliation.add(1, C, digest("other"), 1)
    assert reconciliation.contested() == [1]
    assert reconciliation.refetch_plan([A, B, C]) == {1: B}  # A served it, C was asked
    assert reconciliation.refetch_plan([A, B, C]) == {0: C, 2: C}
    assert reconciliation.refetch_plan([A, B, C]) == {}


@given(
    served=st.lists(st.sampled_from([A, B, C]), min_size=1, max_size=6),
    liars=st.dictionaries(
        st.sampled_from([A, B, C]),
        st.dictionaries(st.integers(0, 5), st.sampled_from(["x", "y"]), max_size=6),
        max_size=3,
    ),
)
def test_honest_providers_are_never_blamed_and_one_suffices(
    served: list[str], liars: dict[str, dict[int, str]]
) -> None:
    """Proof, not suspicion: whoever is blamed served a wrong version of some piece it was
    asked for; and whenever one provider is honest, the true blob is assembled."""
    truth = [f"t{i}" for i in range(len(served))]
    lies = {p: {i: v for i, v in wrong.items() if i < len(served)} for p, wrong in liars.items()}
    blame, rounds = run_reconciliation(served, truth, lies, [A, B, C])
    honest = [p for p in (A, B, C) if not lies.get(p)]
    assert rounds <= 3
    if honest:
        assert blame is not None
    for provider, piece in (blame or {}).items():
        assert lies[provider].get(piece.start, truth[piece.start]) != truth[piece.start]


# -- BlobStore.adopt_verified -------------------------------------------------------------


def test_adopt_verified_moves_a_checked_file_into_the_store(tmp_path: Path) -> None:
    data = os.urandom(100_000)
    blob = hashlib.sha256(data).hexdigest()
    with BlobStore(tmp_path / "store") as store:
        staged = store.root / "partial" / blob
        staged.parent.mkdir()
        staged.write_bytes(data)
        assert store.adopt_verified(staged, blob, len(data)) == blob
        assert not staged.exists()
        assert store.get(blob) == data
        assert store.statistics().blobs_put == 1
        again = store.root / "partial" / "again"
        again.write_bytes(data)
        store.adopt_verified(again, blob, len(data))  # already there: the copy goes away
        assert not again.exists()
        assert store.statistics().blobs_deduplicated == 1


def test_adopt_verified_refuses_a_file_of_the_wrong_size(tmp_path: Path) -> None:
    with BlobStore(tmp_path / "store") as store:
        staged = tmp_path / "short"
        staged.write_bytes(b"abc")
        blob = hashlib.sha256(b"abcd").hexdigest()
        with pytest.raises(LocalError, match="holds 3 bytes, not the 4"):
            store.adopt_verified(staged, blob, 4)
        assert staged.exists() and not store.has(blob)
        with pytest.raises(LocalError, match="malformed blob id"):
            store.adopt_verified(staged, "not an id", 3)


# -- partial downloads left on disk -------------------------------------------------------


def test_partial_downloads_are_listed_by_blob_and_removed_only_when_nobody_fetches(
    tmp_path: Path,
) -> None:
    blob_a, blob_b = hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"b").hexdigest()
    files = {blob_a: 100, f"{blob_a}.json": 20, f"{blob_a}.round0": 30, blob_b: 7}
    for name, size in files.items():
        (tmp_path / name).write_bytes(b"\0" * size)
        os.utime(tmp_path / name, (1000.0, 1000.0))
    os.utime(tmp_path / blob_b, (2000.0, 2000.0))
    (tmp_path / "README").write_text("not a download")
    found = {download.blob_id: download for download in partial_downloads(tmp_path)}
    first, second = found[blob_a], found[blob_b]
    assert list(found) == sorted(found)
    assert (first.blob_id, first.bytes, first.modified) == (blob_a, 150, 1000.0)
    assert first.names == (blob_a, f"{blob_a}.json", f"{blob_a}.round0")
    assert (second.blob_id, second.names, second.modified) == (blob_b, (blob_b,), 2000.0)
    assert partial_downloads(tmp_path / "none") == []
    # a fetch holds the partial file's lock: left alone
    with open(tmp_path / blob_a, "rb") as fetching:
        fcntl.flock(fetching, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert not remove_partial(first, tmp_path, unless_newer=first.modified)
    # written since it was listed: left alone
    os.utime(tmp_path / blob_a, (1500.0, 1500.0))
    assert not remove_partial(first, tmp_path, unless_newer=first.modified)
    assert remove_partial(first, tmp_path, unless_newer=1500.0)
    assert sorted(os.listdir(tmp_path)) == sorted(["README", blob_b])
