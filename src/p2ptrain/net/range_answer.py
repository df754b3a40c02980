"""The head of an answer to a range GET: parsed, and checked against the request (pure).

:func:`parse_head` reads a status line and headers (at most :data:`MAX_HEAD_BYTES`) and
raises :class:`~p2ptrain.errors.ProtocolViolation` on anything else; :func:`body_length`
says how many body bytes to read, or raises the fetcher's error for an answer that does not
fit the request exactly (:class:`MissingBlob`, :class:`BadAnswer`, :class:`UnsupportedAnswer`,
:class:`~p2ptrain.net.client.Refused`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from p2ptrain.errors import ProtocolViolation, TransportError
from p2ptrain.net.client import Refused

__all__ = [
    "MAX_HEAD_BYTES",
    "BadAnswer",
    "MissingBlob",
    "RangeRequest",
    "ResponseHead",
    "TooSlow",
    "UnsupportedAnswer",
    "body_length",
    "fits_a_request_line",
    "parse_head",
]

#: The longest answer head (status line and headers) accepted.
MAX_HEAD_BYTES = 16 << 10
_STATUS_LINE = re.compile(r"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?")
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_DIGITS = re.compile(r"[0-9]{1,19}")
_TARGET = re.compile(r"[!-~]+")  # printable ASCII, no space: safe in a request line


class MissingBlob(TransportError):
    """A provider answered 404: it does not hold the blob."""


class TooSlow(TransportError):
    """A provider delivers far too slowly: it is dropped from the fetch (no strike)."""


class BadAnswer(TransportError):
    """A provider's answer does not fit the request (status, range, length) or is not HTTP."""


class UnsupportedAnswer(TransportError):
    """A valid answer this reader does not read (no ``Content-Length``, or chunked): fetch
    from that provider with a general HTTP client instead."""


# -- the pure part: heads -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    reason: str
    #: Header names lower-cased; a repeated header's values joined with ", ".
    headers: Mapping[str, str]
    #: Whether the connection may carry another request after this answer.
    keep_alive: bool


def parse_head(data: bytes) -> ResponseHead:
    """Parse an HTTP/1.x answer head: the status line and headers, ending with the empty
    line. Raises ProtocolViolation for anything else (and for more than MAX_HEAD_BYTES)."""
    if len(data) > MAX_HEAD_BYTES:
        raise ProtocolViolation(f"answer head of {len(data)} bytes exceeds {MAX_HEAD_BYTES}")
    if not data.endswith(b"\r\n\r\n"):
        raise ProtocolViolation("answer head does not end with an empty line")
    lines = data[:-4].decode("latin-1").split("\r\n")
    status_line = _STATUS_LINE.fullmatch(lines[0])
    if status_line is None:
        raise ProtocolViolation(f"not an HTTP/1.x status line: {lines[0]!r:.80}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not _HEADER_NAME.fullmatch(name):
            raise ProtocolViolation(f"malformed header line {line!r:.80}")
        value = value.strip(" \t")
        if _BAD_VALUE.search(value):
            raise ProtocolViolation(f"control character in header {name!r:.40}")
        name = name.lower()
        if name in headers:
            if name == "content-length" and headers[name] != value:
                raise ProtocolViolation("two different Content-Length headers")
            if name != "content-length":
                headers[name] = f"{headers[name]}, {value}"
            continue
        headers[name] = value
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = "keep-alive" in tokens if status_line[1] == "0" else "close" not in tokens
    return ResponseHead(int(status_line[2]), status_line[3] or "", headers, keep_alive)


@dataclass(frozen=True, slots=True)
class RangeRequest:
    """Bytes ``[start, end)`` of a blob of ``size`` bytes, from ``provider`` (an address)."""

    provider: str
    blob_id: str
    start: int
    end: int
    size: int

    @property
    def path(self) -> str:
        # As PeerClient.request: a relay address has a path prefix.
        return urlsplit(self.provider).path.rstrip("/") + f"/v1/blobs/{self.blob_id}"

    @property
    def url(self) -> str:
        parts = urlsplit(self.provider)
        return f"{parts.scheme}://{parts.netloc}{self.path}"

    def encode(self, authorization: Mapping[str, str]) -> bytes:
        """The request, head only (a GET has no body)."""
        lines = [
            f"GET {self.path} HTTP/1.1",
            f"Host: {urlsplit(self.provider).netloc}",
            f"Range: bytes={self.start}-{self.end - 1}",
            *(f"{name}: {value}" for name, value in authorization.items()),
            "Accept-Encoding: identity",
            "Connection: keep-alive",
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def body_length(head: ResponseHead, request: RangeRequest) -> int:
    """The length of the body to read when ``head`` answers ``request`` with exactly the
    range asked for; otherwise raise what the fetcher acts on (see the module docstring)."""
    provider, start, end, size = request.provider, request.start, request.end, request.size
    status = head.status
    reason = head.headers.get("p2ptrain-reason") or head.reason
    if status == 404:
        raise MissingBlob(f"{provider} does not hold blob {request.blob_id} (404)")
    if status in (401, 403, 429, 503):
        raise Refused(provider, status, reason)
    if status not in (200, 206):
        raise TransportError(f"GET {request.url}: {status} {reason}")
    if status == 200 and (start, end) == (0, size):
        expected_range = None
    elif status == 206:
        expected_range = f"bytes {start}-{end - 1}/{size}"
    else:
        raise BadAnswer(f"{provider} answered {status} to a request for a range")
    content_range = head.headers.get("content-range")
    if expected_range is not None and content_range != expected_range:
        raise BadAnswer(
            f"{provider} sent Content-Range {content_range!r:.80}, not {expected_range!r} "
            "(does it hold a blob of another size?)"
        )
    if "transfer-encoding" in head.headers or "content-length" not in head.headers:
        raise UnsupportedAnswer(f"{provider} sent a body with no Content-Length")
    length = head.headers["content-length"]
    if not _DIGITS.fullmatch(length) or int(length) != end - start:
        raise BadAnswer(f"{provider} announced {length!r:.40} bytes for a range of {end - start}")
    return end - start


def fits_a_request_line(request: RangeRequest) -> bool:
    netloc = urlsplit(request.provider).netloc
    return bool(_TARGET.fullmatch(request.path) and _TARGET.fullmatch(netloc))
