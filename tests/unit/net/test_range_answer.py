"""The pure parts of the range reader: parsing an answer head, and judging whether it is
exactly the range asked for (and if not, which error the fetcher acts on)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2ptrain.errors import ProtocolViolation, TransportError
from p2ptrain.net.client import Refused
from p2ptrain.net.range_answer import (
    MAX_HEAD_BYTES,
    BadAnswer,
    MissingBlob,
    RangeRequest,
    ResponseHead,
    UnsupportedAnswer,
    body_length,
    parse_head,
)

BLOB = "ab" * 32
PROVIDER = "http://127.0.0.1:4000"


def head(status_line: str, *headers: str) -> bytes:
    return "\r\n".join([status_line, *headers, "", ""]).encode("latin-1")


def answer(status: int, **headers: str) -> ResponseHead:
    return ResponseHead(status, "", {k.replace("_", "-"): v for k, v in headers.items()}, True)


def request(start: int, end: int, size: int = 100, provider: str = PROVIDER) -> RangeRequest:
    return RangeRequest(provider, BLOB, start, end, size)


# -- parse_head ---------------------------------------------------------------------------


def test_a_partial_content_head_parses_with_lower_case_names() -> None:
    parsed = parse_head(
        head(
            "HTTP/1.1 206 Partial Content",
            "Content-Range: bytes 10-19/100",
            "Content-Length:10",
            "X-Spaced:   padded value \t",
        )
    )
    assert parsed == ResponseHead(
        206,
        "Partial Content",
        {"content-range": "bytes 10-19/100", "content-length": "10", "x-spaced": "padded value"},
        keep_alive=True,
    )


def test_keep_alive_follows_the_version_and_the_connection_header() -> None:
    assert parse_head(head("HTTP/1.1 200 OK")).keep_alive
    assert not parse_head(head("HTTP/1.1 200 OK", "Connection: close")).keep_alive
    assert not parse_head(head("HTTP/1.1 200 OK", "connection: Upgrade, CLOSE")).keep_alive
    assert not parse_head(head("HTTP/1.0 200 OK")).keep_alive
    assert parse_head(head("HTTP/1.0 200 OK", "Connection: keep-alive")).keep_alive


def test_a_missing_reason_phrase_is_empty_and_repeated_headers_are_joined() -> None:
    parsed = parse_head(head("HTTP/1.1 404", "Via: a", "via: b", "Content-Length: 3"))
    assert (parsed.status, parsed.reason) == (404, "")
    assert parsed.headers["via"] == "a, b"
    same = parse_head(head("HTTP/1.1 200 OK", "Content-Length: 3", "Content-Length: 3"))
    assert same.headers["content-length"] == "3"


@pytest.mark.parametrize(
    "data",
    [
        head("HTTP/1.1 206 Partial", "Content-Length: 1", "Content-Length: 2"),
        head("HTTP/2 200 OK"),
        head("HTTP/1.1 20 OK"),
        head("HTTP/1.1 099 Too low"),
        head("http/1.1 200 OK"),
        head("HTTP/1.1 200 OK", " folded: continuation"),
        head("HTTP/1.1 200 OK", "No colon here"),
        head("HTTP/1.1 200 OK", "Bad Name: x"),
        head("HTTP/1.1 200 OK", ": no name"),
        head("HTTP/1.1 200 OK", "X: bell\x07"),
        head("HTTP/1.1 200 OK\x00"),
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n",  # no empty line
        b"HTTP/1.1 200 OK\n\n",
        head("HTTP/1.1 200 OK", "X: " + "a" * MAX_HEAD_BYTES),
    ],
)
def test_malformed_heads_are_protocol_violations(data: bytes) -> None:
    with pytest.raises(ProtocolViolation):
        parse_head(data)


def test_a_head_of_exactly_the_limit_parses_and_one_byte_more_does_not() -> None:
    prefix = "HTTP/1.1 200 OK\r\nX: "
    filler = "a" * (MAX_HEAD_BYTES - len(prefix) - 4)
    assert len(parse_head((prefix + filler + "\r\n\r\n").encode()).headers["x"]) == len(filler)
    with pytest.raises(ProtocolViolation, match="exceeds"):
        parse_head((prefix + filler + "a\r\n\r\n").encode())


@given(st.binary(max_size=300))
def test_any_bytes_either_parse_or_raise_protocol_violation(data: bytes) -> None:
    for candidate in (data, data + b"\r\n\r\n", b"HTTP/1.1 200 OK\r\n" + data + b"\r\n\r\n"):
        with contextlib.suppress(ProtocolViolation):
            assert 100 <= parse_head(candidate).status <= 999


# -- RangeRequest -------------------------------------------------------------------------


def test_a_request_names_the_range_and_keeps_a_relay_prefix() -> None:
    relayed = request(10, 20, provider="http://seed:1/v1/relay/" + "cd" * 32 + "/")
    assert relayed.path == f"/v1/relay/{'cd' * 32}/v1/blobs/{BLOB}"
    assert relayed.url == f"http://seed:1{relayed.path}"
    assert request(0, 1).path == f"/v1/blobs/{BLOB}"
    lines = relayed.encode({"Authorization": "P2P x"}).decode().split("\r\n")
    assert lines[0] == f"GET {relayed.path} HTTP/1.1"
    assert set(lines[1:-2]) == {
        "Host: seed:1",
        "Range: bytes=10-19",
        "Authorization: P2P x",
        "Accept-Encoding: identity",
        "Connection: keep-alive",
    }
    assert lines[-2:] == ["", ""]


# -- body_length --------------------------------------------------------------------------


def test_exactly_the_range_asked_for_is_read() -> None:
    partial = answer(206, content_range="bytes 10-19/100", content_length="10")
    assert body_length(partial, request(10, 20)) == 10
    whole = answer(200, content_length="100")
    assert body_length(whole, request(0, 100)) == 100
    whole_as_range = answer(206, content_range="bytes 0-99/100", content_length="100")
    assert body_length(whole_as_range, request(0, 100)) == 100


@pytest.mark.parametrize(
    ("answered", "asked", "message"),
    [
        (answer(200, content_length="100"), (10, 20), "answered 200 to a request for a range"),
        (answer(206, content_range="bytes 10-19/101", content_length="10"), (10, 20), "101"),
        (answer(206, content_range="bytes 10-20/100", content_length="11"), (10, 20), "10-20"),
        (answer(206, content_length="10"), (10, 20), "Content-Range None"),
        (answer(206, content_range="bytes 10-19/100", content_length="9"), (10, 20), "'9'"),
        (answer(206, content_range="bytes 10-19/100", content_length="+10"), (10, 20), "+10"),
        (answer(206, content_range="bytes 10-19/100", content_length=" 10"), (10, 20), "10"),
        (answer(200, content_length="99"), (0, 100), "99"),
        (answer(204), (10, 20), "answered 204"),
    ],
)
def test_an_answer_that_does_not_fit_the_request_is_a_bad_answer(
    answered: ResponseHead, asked: tuple[int, int], message: str
) -> None:
    if answered.status == 204:  # not a status we ask for: a plain transport error
        with pytest.raises(TransportError, match="204") as caught:
            body_length(answered, request(*asked))
        assert not isinstance(caught.value, BadAnswer | MissingBlob)
        return
    with pytest.raises(BadAnswer, match=message.replace("+", r"\+")):
        body_length(answered, request(*asked))


def test_a_body_without_a_length_is_unsupported_not_bad() -> None:
    chunked = answer(
        206, content_range="bytes 10-19/100", content_length="10", transfer_encoding="chunked"
    )
    with pytest.raises(UnsupportedAnswer):
        body_length(chunked, request(10, 20))
    with pytest.raises(UnsupportedAnswer):
        body_length(answer(206, content_range="bytes 10-19/100"), request(10, 20))


def test_error_statuses_map_to_what_the_fetcher_acts_on() -> None:
    with pytest.raises(MissingBlob, match=f"does not hold blob {BLOB} \\(404\\)"):
        body_length(answer(404), request(0, 10))
    for status in (401, 403, 429, 503):
        with pytest.raises(Refused) as refused:
            body_length(answer(status, p2ptrain_reason="banned for a while"), request(0, 10))
        assert (refused.value.status, refused.value.reason) == (status, "banned for a while")
        assert refused.value.address == PROVIDER
    with pytest.raises(
        TransportError, match=f"{PROVIDER}/v1/blobs/{BLOB}: 500 Server Error"
    ) as caught:
        body_length(ResponseHead(500, "Server Error", {}, True), request(0, 10))
    assert not isinstance(caught.value, BadAnswer | MissingBlob | Refused)
