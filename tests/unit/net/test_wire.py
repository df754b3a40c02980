"""Control-plane frames: round trips, the checks on each frame type, and a decoder that only
ever returns a frame or raises ProtocolViolation."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.errors import ProtocolViolation
from p2ptrain.net.wire import (
    ID_BYTES,
    MAX_IDS,
    MAX_RELAY_HEADERS,
    MAX_TOPICS,
    Bye,
    Frame,
    Gossip,
    Have,
    RelayChunk,
    RelayHead,
    RelayRequest,
    Subscribe,
    Want,
    decode_frame,
    encode_frame,
    valid_topic,
)
from tests.support.builders import h

LIMIT = 1 << 20
NET_TOPIC = "net/" + h("network")
EXP_TOPIC = "exp/" + h("experiment")
FRAME_TYPES = (Subscribe, Gossip, Have, Want, RelayRequest, RelayHead, RelayChunk, Bye)

FRAMES: list[Frame] = [
    Subscribe([NET_TOPIC, EXP_TOPIC]),
    Subscribe([]),
    Subscribe([EXP_TOPIC], ["attestation", "proposal"]),
    Have([b"\x01" * ID_BYTES, b"\x02" * ID_BYTES]),
    Want([b"\x03" * ID_BYTES]),
    Want([]),
    Gossip(NET_TOPIC, "peer", b"\x00\x01signed envelope"),
    Gossip(EXP_TOPIC, "certificate", b""),
    RelayRequest(7, "GET", "/v1/blobs/" + h("blob"), "bytes=0-99"),
    RelayRequest(2**63 - 1, "HEAD", "/v1/peers"),
    RelayHead(7, 206, {"Content-Range": "bytes 0-99/1000"}),
    RelayHead(8, 404, {}),
    RelayChunk(7, b"\xff" * 100, last=True),
    RelayChunk(7, b"", last=False),
    Bye("shutting down"),
    Bye(""),
]


def raw(**fields: Any) -> bytes:
    """A frame as a peer could write it, without going through the frame classes."""
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    "frame", FRAMES, ids=[f"{type(f).__name__}-{i}" for i, f in enumerate(FRAMES)]
)
def test_every_frame_type_round_trips(frame: Frame) -> None:
    data = encode_frame(frame)
    again = decode_frame(data, max_bytes=len(data))
    assert again == frame
    assert type(again) is type(frame)
    assert encode_frame(again) == data


def test_a_frame_is_a_tagged_msgpack_map() -> None:
    assert msgspec.msgpack.decode(encode_frame(Bye("done"))) == {"type": "bye", "reason": "done"}
    assert decode_frame(raw(type="rch", request_id=3, data=b"x"), max_bytes=LIMIT) == RelayChunk(
        3, b"x", last=False
    )


def test_the_size_limit_is_enforced_before_decoding() -> None:
    data = encode_frame(Gossip(NET_TOPIC, "peer", b"x" * 1000))
    assert decode_frame(data, max_bytes=len(data)) == Gossip(NET_TOPIC, "peer", b"x" * 1000)
    with pytest.raises(ProtocolViolation, match=f"{len(data)} bytes exceeds the limit"):
        decode_frame(data, max_bytes=len(data) - 1)
    with pytest.raises(ProtocolViolation, match="exceeds"):
        decode_frame(b"\xc1" * 10, max_bytes=9)  # never parsed, so the size is what fails


@pytest.mark.parametrize(
    ("topic", "ok"),
    [
        (NET_TOPIC, True),
        ("abcdefghijklmnop/" + "0" * 64, True),
        ("abcdefghijklmnopq/" + "0" * 64, False),  # space name of 17 letters
        ("/" + "0" * 64, False),
        ("net/" + "0" * 63, False),
        ("net/" + "0" * 65, False),
        ("net/" + "A" * 64, False),  # upper-case hex
        ("Net/" + "0" * 64, False),
        ("net/" + "0" * 64 + "\n", False),
        ("net-" + "0" * 64, False),
        ("", False),
    ],
)
def test_valid_topic(topic: str, ok: bool) -> None:
    assert valid_topic(topic) is ok


@pytest.mark.parametrize(
    "data",
    [
        raw(type="sub", topics=["net/zz"]),
        raw(type="sub", topics=[NET_TOPIC, "exp/" + "g" * 64]),
        raw(type="sub", topics=[f"t/{i:064x}" for i in range(MAX_TOPICS + 1)]),
        raw(type="sub", topics=[], skip=["k" * 33]),
        raw(type="sub", topics=[], skip=["k"] * (MAX_TOPICS + 1)),
        raw(type="gos", topic="net", kind="peer", data=b""),
        raw(type="gos", topic=NET_TOPIC, kind="k" * 33, data=b""),
        raw(type="hav", ids=[b"\x01" * (ID_BYTES + 1)]),
        raw(type="hav", ids=[b"\x01" * ID_BYTES] * (MAX_IDS + 1)),
        raw(type="wnt", ids=[b""]),
        raw(type="rrq", request_id=1, method="POST", path="/v1/blobs"),
        raw(type="rrq", request_id=1, method="get", path="/v1/peers"),
        raw(type="rrq", request_id=1, method="GET", path="/" + "p" * 512),
        raw(type="rrq", request_id=1, method="GET", path="/", range="b" * 129),
        raw(type="rhd", request_id=1, status=99, headers={}),
        raw(type="rhd", request_id=1, status=600, headers={}),
        raw(type="rhd", request_id=1, status=200, headers={f"h{i}": "v" for i in range(17)}),
        raw(type="rhd", request_id=1, status=200, headers={"k" * 65: "v"}),
        raw(type="rhd", request_id=1, status=200, headers={"k": "v" * 513}),
        raw(type="bye", reason="r" * 513),
    ],
    ids=[
        "sub-bad-topic",
        "sub-one-bad-topic",
        "sub-too-many-topics",
        "sub-long-skip",
        "sub-too-many-skips",
        "gos-bad-topic",
        "gos-long-kind",
        "hav-long-id",
        "hav-too-many-ids",
        "wnt-short-id",
        "rrq-post",
        "rrq-lowercase-method",
        "rrq-long-path",
        "rrq-long-range",
        "rhd-status-99",
        "rhd-status-600",
        "rhd-too-many-headers",
        "rhd-long-header-name",
        "rhd-long-header-value",
        "bye-long-reason",
    ],
)
def test_malformed_frames_are_protocol_violations(data: bytes) -> None:
    with pytest.raises(ProtocolViolation):
        decode_frame(data, max_bytes=LIMIT)


@pytest.mark.parametrize(
    "data",
    [
        raw(type="sub", topics=[f"t/{i:064x}" for i in range(MAX_TOPICS)]),
        raw(type="gos", topic=NET_TOPIC, kind="k" * 32, data=b""),
        raw(type="hav", ids=[b"\x01" * ID_BYTES] * MAX_IDS),
        raw(type="rrq", request_id=1, method="GET", path="/" + "p" * 511, range="b" * 128),
        raw(type="rhd", request_id=1, status=100, headers={}),
        raw(type="rhd", request_id=1, status=599, headers={}),
        raw(
            type="rhd",
            request_id=1,
            status=200,
            headers={f"{i:064d}": "v" * 512 for i in range(MAX_RELAY_HEADERS)},
        ),
        raw(type="bye", reason="r" * 512),
    ],
    ids=[
        "sub-64",
        "gos-kind-32",
        "hav-1024",
        "rrq-limits",
        "rhd-100",
        "rhd-599",
        "rhd-16-long",
        "bye-512",
    ],
)
def test_frames_at_the_limits_are_accepted(data: bytes) -> None:
    assert isinstance(decode_frame(data, max_bytes=LIMIT), FRAME_TYPES)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        raw(type="nope", reason="x"),
        raw(reason="untagged"),
        raw(type="bye", reason="x", extra=1),
        raw(type="bye"),
        raw(type="bye", reason=5),
        raw(type="rch", request_id="one", data=b""),
        raw(type="rhd", request_id=1, status=True, headers={}),
        msgspec.msgpack.encode(["bye", "x"]),
        b"\x81\xa4type\xa3bye\xa6reason\xa1x" + b"trailing",
    ],
)
def test_undecodable_frames_are_protocol_violations(data: bytes) -> None:
    with pytest.raises(ProtocolViolation):
        decode_frame(data, max_bytes=LIMIT)


# -- properties -----------------------------------------------------------------------------

topics = st.builds(
    "{}/{}".format,
    st.from_regex(r"[a-z]{1,16}", fullmatch=True),
    st.binary(min_size=32, max_size=32).map(bytes.hex),
)
short_text = st.text(max_size=40)
valid_frames: st.SearchStrategy[Frame] = st.one_of(
    st.builds(Subscribe, st.lists(topics, max_size=8)),
    st.builds(Gossip, topics, st.text(max_size=32), st.binary(max_size=256)),
    st.builds(
        RelayRequest,
        st.integers(-(2**63), 2**64 - 1),
        st.sampled_from(["GET", "HEAD"]),
        st.text(max_size=100),
        st.none() | st.text(max_size=128),
    ),
    st.builds(
        RelayHead,
        st.integers(0, 2**32),
        st.integers(100, 599),
        st.dictionaries(st.text(max_size=64), st.text(max_size=100), max_size=MAX_RELAY_HEADERS),
    ),
    st.builds(RelayChunk, st.integers(0, 2**32), st.binary(max_size=256), st.booleans()),
    st.builds(Bye, st.text(max_size=512)),
)


def _encodable(frame: Frame) -> bool:
    try:
        encode_frame(frame)
    except UnicodeEncodeError:
        return False  # a lone surrogate in a str field: not something we would send
    return True


@settings(max_examples=500)
@given(valid_frames.filter(_encodable))
def test_every_valid_frame_round_trips(frame: Frame) -> None:
    data = encode_frame(frame)
    assert decode_frame(data, max_bytes=len(data)) == frame


@settings(max_examples=2000)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_to_a_frame_or_raise_protocol_violation(data: bytes) -> None:
    with contextlib.suppress(ProtocolViolation):
        frame = decode_frame(data, max_bytes=LIMIT)
        assert isinstance(frame, FRAME_TYPES)


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64 - 1)
    | st.floats()
    | st.text(max_size=80)
    | st.binary(max_size=80)
)
_anything = (
    _leaves
    | st.lists(_leaves | topics, max_size=8)
    | st.dictionaries(st.text(max_size=70), _leaves, max_size=MAX_RELAY_HEADERS + 2)
)


def _field(likely: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually a value of the right type (so the frame checks run), sometimes anything."""
    return st.integers(0, 9).flatmap(lambda roll: _anything if roll == 0 else likely)


_texts = st.text(max_size=40) | st.text(max_size=600)
#: Each tag's fields, required then optional; values near and beyond the checked limits.
_SCHEMAS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sub": ({"topics": st.lists(topics | _texts, max_size=MAX_TOPICS + 2)}, {}),
    "gos": ({"topic": topics | _texts, "kind": _texts, "data": st.binary(max_size=64)}, {}),
    "rrq": (
        {
            "request_id": st.integers(-(2**63), 2**64 - 1),
            "method": st.sampled_from(["GET", "HEAD", "POST", "get", ""]),
            "path": _texts,
        },
        {"range": st.none() | _texts},
    ),
    "rhd": (
        {
            "request_id": st.integers(-(2**63), 2**64 - 1),
            "status": st.integers(-1, 1000),
            "headers": st.dictionaries(_texts, _texts, max_size=MAX_RELAY_HEADERS + 2),
        },
        {},
    ),
    "rch": (
        {"request_id": st.integers(-(2**63), 2**64 - 1), "data": st.binary(max_size=64)},
        {"last": st.booleans()},
    ),
    "bye": ({"reason": _texts}, {}),
}
_tagged_maps = st.one_of(
    *(
        st.fixed_dictionaries(
            {"type": st.just(tag), **{k: _field(v) for k, v in required.items()}},
            optional={
                **{k: _field(v) for k, v in optional.items()},
                "extra": _anything,
            },
        )
        for tag, (required, optional) in _SCHEMAS.items()
    ),
    st.dictionaries(st.text(max_size=10), _anything, max_size=4),
)


@settings(max_examples=1000)
@given(_tagged_maps)
def test_tagged_maps_with_arbitrary_fields_decode_or_raise_protocol_violation(
    fields: dict[str, Any],
) -> None:
    try:
        data = msgspec.msgpack.encode(fields)
    except (OverflowError, UnicodeEncodeError):
        return  # not representable in msgpack, so no peer can send it
    with contextlib.suppress(ProtocolViolation):
        frame = decode_frame(data, max_bytes=LIMIT)
        assert isinstance(frame, FRAME_TYPES)
