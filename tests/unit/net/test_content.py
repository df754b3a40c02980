"""What a node serves: Range parsing, and LocalContent's answers for blobs, peer records and
certified heads (a real BlobStore in a temporary directory, no sockets)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.core.encoding import decode
from p2ptrain.core.envelope import Signed, verify_envelope
from p2ptrain.core.identity import Identity
from p2ptrain.core.records import PeerRecord
from p2ptrain.net.client import HeadLinks, PeerRecords
from p2ptrain.net.content import LocalContent, parse_range
from p2ptrain.net.peers import PeerBook
from p2ptrain.protocol.chain import MAX_LINKS_PER_PAGE as MAX_LINKS_PER_ANSWER
from p2ptrain.protocol.chain import HeadChain, genesis_head
from p2ptrain.store.blobs import BlobStore
from tests.support.builders import certified_chain, experiment, h, identity
from tests.support.builders import peer_record as signed_record

SEED = 5150
NETWORK_ID = h("network")
ME = identity(10)
VALIDATORS = [identity(i) for i in range(5)]
MANIFEST = experiment(VALIDATORS, quorum=3)
GENESIS = genesis_head(MANIFEST)

# -- parse_range ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "size", "span"),
    [
        (None, 1000, None),
        ("bytes=0-99", 1000, (0, 100)),
        ("bytes=0-0", 1000, (0, 1)),
        ("bytes=999-999", 1000, (999, 1000)),
        ("bytes=900-", 1000, (900, 1000)),
        ("bytes=0-", 1000, (0, 1000)),
        ("bytes=-100", 1000, (900, 1000)),
        ("bytes=-1", 1000, (999, 1000)),
        ("bytes=-5000", 1000, (0, 1000)),  # a suffix longer than the blob is the whole blob
        ("bytes=500-5000", 1000, (500, 1000)),  # end beyond the blob is clamped
        ("bytes=0-999", 1000, (0, 1000)),
        ("  bytes=10-19  ", 1000, (10, 20)),
        ("bytes=0-0", 1, (0, 1)),
    ],
)
def test_parse_range(header: str | None, size: int, span: tuple[int, int] | None) -> None:
    assert parse_range(header, size) == span


@pytest.mark.parametrize(
    ("header", "size"),
    [
        ("bytes=1000-", 1000),  # starts at the end
        ("bytes=1000-1999", 1000),
        ("bytes=5000-6000", 1000),
        ("bytes=0-0", 0),  # nothing in an empty blob
        ("bytes=-1", 0),
        ("bytes=-0", 1000),  # an empty suffix
        ("bytes=10-9", 1000),  # last before first
    ],
)
def test_unsatisfiable_ranges_raise_value_error(header: str, size: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        parse_range(header, size)


@pytest.mark.parametrize(
    "header",
    [
        "bytes=a-b",
        "items=0-1",
        "bytes=-",
        "bytes=",
        "",
        "bytes 0-1",
        "bytes=0-1,5-6",  # multiple ranges are not served
        "bytes=+1-2",
        "bytes=0x10-",
        "Bytes=0-1",
    ],
)
def test_malformed_ranges_raise_value_error(header: str) -> None:
    with pytest.raises(ValueError, match="unsupported Range"):
        parse_range(header, 1000)


@pytest.mark.parametrize(
    "header",
    [
        "bytes=\u0661\u0660-\u0661\u0669",  # ARABIC-INDIC DIGITs: "10-19"
        "bytes=\uff11-",  # FULLWIDTH DIGIT ONE
    ],
)
def test_only_ascii_digits_make_a_range(header: str) -> None:
    # RFC 9110 section 14.1.1: a range is DIGITs, and DIGIT is ASCII 0-9 (RFC 5234).
    with pytest.raises(ValueError, match="unsupported Range"):
        parse_range(header, 1000)


@settings(max_examples=1000)
@given(
    st.text(max_size=40) | st.from_regex(r"bytes=\d{0,6}-\d{0,6}", fullmatch=True),
    st.integers(0, 10**6),
)
def test_any_range_header_gives_a_span_inside_the_blob_or_value_error(
    header: str, size: int
) -> None:
    try:
        span = parse_range(header, size)
    except ValueError:
        return
    assert span is not None
    start, end = span
    assert 0 <= start < end <= size


# -- LocalContent ---------------------------------------------------------------------------


def peer_record(who: Identity, seq: int = 1) -> Signed[PeerRecord]:
    return signed_record(who, seq, network_id=NETWORK_ID, address=f"http://127.0.0.1:{7000 + seq}")


def chain_of(length: int) -> HeadChain:
    return certified_chain(MANIFEST, VALIDATORS[:3], length)


SELF_RECORD = peer_record(ME, seq=3)


@pytest.fixture
def blobs(tmp_path: Path) -> Iterator[BlobStore]:
    with BlobStore(tmp_path / "blobs") as store:
        yield store


@pytest.fixture
def content(blobs: BlobStore) -> LocalContent:
    book = PeerBook(NETWORK_ID, self_id=ME.peer_id, strikes_to_ban=3, ban_s=60.0)
    return LocalContent(blobs, book, lambda: SELF_RECORD)


@pytest.fixture
def blob(blobs: BlobStore) -> tuple[str, bytes]:
    print(f"blob seed {SEED}")
    data = random.Random(SEED).randbytes(1000)
    return blobs.put(data), data


def served_bytes(answer_file: Path | None, offset: int, length: int) -> bytes:
    assert answer_file is not None
    with open(answer_file, "rb") as file:
        file.seek(offset)
        return file.read(length)


def test_a_whole_blob_is_answered_200_from_its_file(
    content: LocalContent, blob: tuple[str, bytes]
) -> None:
    blob_id, data = blob
    answer = content.answer("GET", f"/v1/blobs/{blob_id}")
    assert answer.status == 200
    assert answer.headers == {
        "Content-Type": "application/octet-stream",
        "Accept-Ranges": "bytes",
    }
    assert (answer.offset, answer.length) == (0, 1000)
    assert answer.body == b""
    assert served_bytes(answer.file, answer.offset, answer.length) == data


def test_a_range_of_a_blob_is_answered_206_with_content_range(
    content: LocalContent, blob: tuple[str, bytes]
) -> None:
    blob_id, data = blob
    answer = content.answer("GET", f"/v1/blobs/{blob_id}", "bytes=100-199")
    assert answer.status == 206
    assert answer.headers["Content-Range"] == "bytes 100-199/1000"
    assert answer.headers["Accept-Ranges"] == "bytes"
    assert (answer.offset, answer.length) == (100, 100)
    assert served_bytes(answer.file, answer.offset, answer.length) == data[100:200]

    suffix = content.answer("GET", f"/v1/blobs/{blob_id}", "bytes=-10")
    assert suffix.status == 206
    assert suffix.headers["Content-Range"] == "bytes 990-999/1000"
    assert served_bytes(suffix.file, suffix.offset, suffix.length) == data[-10:]


@pytest.mark.parametrize("header", ["bytes=1000-", "bytes=a-b", "bytes=-0"])
def test_an_unsatisfiable_range_is_answered_416(
    content: LocalContent, blob: tuple[str, bytes], header: str
) -> None:
    blob_id, _ = blob
    answer = content.answer("GET", f"/v1/blobs/{blob_id}", header)
    assert answer.status == 416
    assert answer.headers["Content-Range"] == "bytes */1000"
    assert answer.file is None
    assert answer.body  # says why


def test_an_unknown_blob_is_answered_404(content: LocalContent) -> None:
    missing = h("not stored")
    answer = content.answer("GET", f"/v1/blobs/{missing}")
    assert answer.status == 404
    assert missing in answer.body.decode()
    assert answer.file is None


@pytest.mark.parametrize(
    "target",
    [
        "/v1/blobs/" + "A" * 64,
        "/v1/blobs/" + "0" * 63,
        "/v1/blobs/../etc/passwd",
        "/v1/nothing",
        "/",
        "/v1/heads/xyz",
        "/v1/peers/extra",
    ],
)
def test_an_unknown_resource_is_answered_404(content: LocalContent, target: str) -> None:
    answer = content.answer("GET", target)
    assert answer.status == 404
    assert answer.file is None
    assert answer.body.startswith(b"no such resource")


def test_the_peer_list_starts_with_our_own_record(content: LocalContent) -> None:
    others = [peer_record(identity(20)), peer_record(identity(21), seq=2)]
    for record in others:
        assert content.peers.add(record)
    answer = content.answer("GET", "/v1/peers")
    assert answer.status == 200
    assert answer.headers["Content-Type"] == "application/msgpack"
    records = decode(PeerRecords, answer.body, max_bytes=1 << 20).records
    assert records[0] == SELF_RECORD.envelope
    assert verify_envelope(records[0], PeerRecord).record.peer_id == ME.peer_id
    assert sorted(e.signature for e in records[1:]) == sorted(r.envelope.signature for r in others)
    assert len(records) == 3


def test_the_peer_list_of_a_lonely_node_is_its_own_record(content: LocalContent) -> None:
    records = decode(PeerRecords, content.answer("GET", "/v1/peers").body, max_bytes=1 << 20)
    assert records.records == [SELF_RECORD.envelope]


def test_heads_of_an_experiment_not_followed_are_404(content: LocalContent) -> None:
    answer = content.answer("GET", f"/v1/heads/{MANIFEST.id}")
    assert answer.status == 404
    assert b"does not follow" in answer.body


def test_heads_are_served_after_a_height(content: LocalContent) -> None:
    chain = chain_of(3)
    content.chains[MANIFEST.id] = chain
    answer = content.answer("GET", f"/v1/heads/{MANIFEST.id}")
    assert answer.status == 200
    assert answer.headers["Content-Type"] == "application/msgpack"
    links = decode(HeadLinks, answer.body, max_bytes=1 << 20).links
    assert [head.height for head, _ in links] == [1, 2, 3]
    assert links == chain.links_after(0)
    assert all(cert.head_id == head.id for head, cert in links)

    after_two = content.answer("GET", f"/v1/heads/{MANIFEST.id}?after=2")
    assert [
        head.height for head, _ in decode(HeadLinks, after_two.body, max_bytes=1 << 20).links
    ] == [3]
    at_tip = content.answer("GET", f"/v1/heads/{MANIFEST.id}?after=3")
    assert decode(HeadLinks, at_tip.body, max_bytes=1 << 20).links == []


@pytest.mark.parametrize("query", ["after=x", "after=1.5", "after=", "after=0x1"])
def test_a_height_that_is_not_an_integer_is_answered_400(content: LocalContent, query: str) -> None:
    content.chains[MANIFEST.id] = chain_of(1)
    answer = content.answer("GET", f"/v1/heads/{MANIFEST.id}?{query}")
    if query == "after=":
        # A blank value is dropped by the query parser: the default height 0 applies.
        assert answer.status == 200
        return
    assert answer.status == 400
    assert b"after=" in answer.body


def test_one_answer_carries_at_most_the_link_limit(content: LocalContent) -> None:
    content.chains[MANIFEST.id] = chain_of(MAX_LINKS_PER_ANSWER + 2)
    answer = content.answer("GET", f"/v1/heads/{MANIFEST.id}?after=1")
    links = decode(HeadLinks, answer.body, max_bytes=1 << 24).links
    assert len(links) == MAX_LINKS_PER_ANSWER
    assert links[0][0].height == 2
    assert links[-1][0].height == MAX_LINKS_PER_ANSWER + 1


def test_a_page_says_the_tip_and_which_states_are_held(content: LocalContent) -> None:
    """A node catching up learns how far the chain goes, and which heads' states (weights
    and optimizer state) the provider still holds: it never asks for collected ones."""
    chain = chain_of(MAX_LINKS_PER_ANSWER + 40)
    content.chains[MANIFEST.id] = chain
    tip = chain.height
    for height in (tip, tip - 1, tip - 2, 5):  # the kept heads, and an old one
        content.blobs.put(f"weights-{height}-a".encode())  # the names of builders' heads
    content.blobs.put(f"aggregate-{tip - 5}-a".encode())  # an aggregate alone is no state
    first = decode(
        HeadLinks, content.answer("GET", f"/v1/heads/{MANIFEST.id}").body, max_bytes=1 << 24
    )
    assert first.tip == tip
    assert first.links[-1][0].height == MAX_LINKS_PER_ANSWER
    # only the newest heads are said: height 5 is too far below the tip
    assert first.held == [tip - 2, tip - 1, tip]
    rest = content.answer("GET", f"/v1/heads/{MANIFEST.id}?after={MAX_LINKS_PER_ANSWER}")
    last = decode(HeadLinks, rest.body, max_bytes=1 << 24)
    assert [head.height for head, _ in last.links] == list(range(MAX_LINKS_PER_ANSWER + 1, tip + 1))
