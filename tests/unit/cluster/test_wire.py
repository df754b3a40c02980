"""The cluster's control frames: any bytes from a peer decode or raise ProtocolViolation,
nothing else (h11's fuzz invariant), and frames longer than the limit are refused before
they are read."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.cluster.wire import (
    MAX_FRAME_BYTES,
    Hello,
    decode_frame,
    decode_reply,
    decode_request,
    frame_bytes,
    frame_length,
)
from p2ptrain.errors import ProtocolViolation


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_any_bytes_decode_or_raise_a_protocol_violation(data: bytes) -> None:
    for decode in (decode_frame, decode_request, decode_reply):
        with contextlib.suppress(ProtocolViolation):
            decode(data)


def test_a_frame_round_trips_and_an_oversized_length_is_refused() -> None:
    hello = Hello(cluster_id="home", public_key=b"k" * 32, nonce=b"n" * 32)
    encoded = frame_bytes(hello)
    assert frame_length(encoded[:4]) == len(encoded) - 4
    assert decode_frame(encoded[4:]) == hello
    with pytest.raises(ProtocolViolation, match="at most"):
        frame_length(struct.pack(">I", MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolViolation):
        frame_length(struct.pack(">I", 0))
