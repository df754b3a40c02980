"""What a node serves, independent of how the request reached it (HTTP or a seed relay).

``answer(method, path, range)`` maps a request for blobs, peer records or certified heads to
an :class:`Answer`: a status, headers, and either bytes or a byte range of a blob file. The
HTTP server sends blobs with ``sendfile``; a relayed node streams the same range over its
WebSocket.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from p2ptrain.core.encoding import encode
from p2ptrain.core.envelope import Signed
from p2ptrain.core.records import Head, PeerRecord
from p2ptrain.net.client import HeadLinks, PeerRecords
from p2ptrain.net.peers import PeerBook
from p2ptrain.protocol.chain import MAX_LINKS_PER_PAGE, HeadChain
from p2ptrain.store.blobs import BlobStore

__all__ = ["Answer", "LocalContent", "parse_range", "text_answer"]

_BLOB_PATH = re.compile(r"/v1/blobs/([0-9a-f]{64})")
_HEADS_PATH = re.compile(r"/v1/heads/([0-9a-f]{64})")
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    #: For blob answers: the file, and the byte range [offset, offset + length) to send.
    file: Path | None = None
    offset: int = 0
    length: int = 0


def text_answer(status: int, message: str) -> Answer:
    return Answer(status, {"Content-Type": "text/plain; charset=utf-8"}, message.encode())


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The byte range ``[start, end)`` a ``Range`` header asks for; None for the whole blob.
    Raises ValueError when it cannot be satisfied (answer 416)."""
    if header is None:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        raise ValueError(f"unsupported Range {header!r:.60}; use bytes=START-END")
    first, last = match.group(1), match.group(2)
    if first == "":
        start, end = max(0, size - int(last)), size
    else:
        start = int(first)
        end = size if last == "" else min(size, int(last) + 1)
    if start >= end:
        raise ValueError(f"Range {header!r:.60} is outside the blob's {size} bytes")
    return start, end


class LocalContent:
    """Answers read requests from this node's blob store, peer book and head chains."""

    def __init__(
        self,
        blobs: BlobStore,
        peers: PeerBook,
        self_record: Callable[[], Signed[PeerRecord]],
    ) -> None:
        self.blobs = blobs
        self.peers = peers
        self._self_record = self_record
        self.chains: dict[str, HeadChain] = {}
        #: Further read-only answers the node above adds, by path prefix (records, status,
        #: the network manifest): ``handler(target) -> Answer``.
        self.handlers: dict[str, Callable[[str], Answer]] = {}

    def answer(self, method: str, target: str, range_header: str | None = None) -> Answer:
        parts = urlsplit(target)
        path = parts.path
        if path == "/v1/peers":
            records = [self._self_record().envelope, *(s.envelope for s in self.peers)]
            body = encode(PeerRecords(records))
            return Answer(200, {"Content-Type": "application/msgpack"}, body)
        if match := _BLOB_PATH.fullmatch(path):
            return self._blob(match.group(1), range_header)
        if match := _HEADS_PATH.fullmatch(path):
            chain = self.chains.get(match.group(1))
            if chain is None:
                return text_answer(404, "this node does not follow that experiment")
            try:
                after = int(parse_qs(parts.query).get("after", ["0"])[0])
            except ValueError:
                return text_answer(400, "after= must be an integer height")
            page = HeadLinks(
                chain.links_after(after)[:MAX_LINKS_PER_PAGE],
                tip=chain.height,
                held=sorted(chain.held_heights(self._holds)),
            )
            return Answer(200, {"Content-Type": "application/msgpack"}, encode(page))
        for prefix, handler in self.handlers.items():
            if path.startswith(prefix):
                return handler(target)
        return text_answer(404, f"no such resource {path[:80]!r}")

    def _holds(self, head: Head) -> bool:
        """Whether the store holds the state of ``head``: its weights and optimizer state."""
        named = (head.weights_blob, head.optimizer_blob)
        return all(self.blobs.has(blob_id) for blob_id in named if blob_id is not None)

    def _blob(self, blob_id: str, range_header: str | None) -> Answer:
        if not self.blobs.has(blob_id):
            return text_answer(404, f"this node does not hold blob {blob_id}")
        path = self.blobs.path(blob_id)
        size = path.stat().st_size
        try:
            span = parse_range(range_header, size)
        except ValueError as exc:
            return Answer(416, {"Content-Range": f"bytes */{size}"}, str(exc).encode())
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if span is None:
            return Answer(200, headers, file=path, offset=0, length=size)
        start, end = span
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        return Answer(206, headers, file=path, offset=start, length=end - start)
