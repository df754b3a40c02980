"""WebSocket frames of the control plane: one binary msgpack message per frame.

Frames are not signed: what they carry is. A gossip frame carries a signed envelope (or a
quorum certificate, which carries its validators' signatures), and relayed blob bytes are
hash-checked by whoever asked for them. Every decode is bounded and any bad frame raises
:class:`~p2ptrain.errors.ProtocolViolation`, nothing else.
"""

from __future__ import annotations

import re

import msgspec

from p2ptrain.core.encoding import DECODE_FAILURES
from p2ptrain.errors import ProtocolViolation

__all__ = [
    "Bye",
    "Frame",
    "Gossip",
    "Have",
    "RelayChunk",
    "RelayHead",
    "RelayRequest",
    "Subscribe",
    "Want",
    "decode_frame",
    "encode_frame",
]

MAX_TOPICS = 64
#: Message ids in one ``Have`` or ``Want`` frame, at most.
MAX_IDS = 1024
#: Bytes of a message id: a prefix of the SHA-256 of the message's ``data``.
ID_BYTES = 16
MAX_RELAY_HEADERS = 16
_TOPIC = re.compile(r"[a-z]{1,16}/[0-9a-f]{64}")


class Subscribe(msgspec.Struct, frozen=True, tag="sub", forbid_unknown_fields=True):
    """The topics the sender wants gossip for (replaces what it said before), and the kinds
    of message it has no use for: nobody sends it those, neither bodies nor ids."""

    topics: list[str]
    skip: list[str] = []


class Gossip(msgspec.Struct, frozen=True, tag="gos", forbid_unknown_fields=True):
    """One flooded message: ``kind`` names an envelope kind, or ``certificate``."""

    topic: str
    kind: str
    data: bytes


class Have(msgspec.Struct, frozen=True, tag="hav", forbid_unknown_fields=True):
    """Messages the sender holds and accepted, by id (16 bytes of the SHA-256 of their
    ``data``): a
    neighbour that lacks one asks for it with ``Want``."""

    ids: list[bytes]


class Want(msgspec.Struct, frozen=True, tag="wnt", forbid_unknown_fields=True):
    """The sender asks for the bodies (``Gossip`` frames) of messages announced to it."""

    ids: list[bytes]


class RelayRequest(msgspec.Struct, frozen=True, tag="rrq", forbid_unknown_fields=True):
    """A seed asks a private peer to answer an HTTP request on someone's behalf."""

    request_id: int
    method: str
    path: str
    range: str | None = None


class RelayHead(msgspec.Struct, frozen=True, tag="rhd", forbid_unknown_fields=True):
    request_id: int
    status: int
    headers: dict[str, str]


class RelayChunk(msgspec.Struct, frozen=True, tag="rch", forbid_unknown_fields=True):
    request_id: int
    data: bytes
    last: bool = False


class Bye(msgspec.Struct, frozen=True, tag="bye", forbid_unknown_fields=True):
    """The sender is closing the connection, and says why."""

    reason: str


Frame = Subscribe | Gossip | Have | Want | RelayRequest | RelayHead | RelayChunk | Bye

_ENCODER = msgspec.msgpack.Encoder()
_DECODER: msgspec.msgpack.Decoder[Frame] = msgspec.msgpack.Decoder(Frame)


def valid_topic(topic: str) -> bool:
    """Topics are ``<space>/<64-hex id>``: ``net/<network id>``, ``exp/<experiment id>``."""
    return bool(_TOPIC.fullmatch(topic))


def encode_frame(frame: Frame) -> bytes:
    return _ENCODER.encode(frame)


def decode_frame(data: bytes, *, max_bytes: int) -> Frame:
    """Decode one frame from a peer, or raise ProtocolViolation."""
    if len(data) > max_bytes:
        raise ProtocolViolation(f"frame of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        frame = _DECODER.decode(data)
    except DECODE_FAILURES as exc:
        raise ProtocolViolation(f"undecodable frame: {exc}") from exc
    _check(frame)
    return frame


def _check(frame: Frame) -> None:
    if isinstance(frame, Subscribe):
        if len(frame.topics) > MAX_TOPICS or not all(valid_topic(t) for t in frame.topics):
            raise ProtocolViolation(f"subscribe frame: at most {MAX_TOPICS} well-formed topics")
        if len(frame.skip) > MAX_TOPICS or any(len(k) > 32 for k in frame.skip):
            raise ProtocolViolation(f"subscribe frame: at most {MAX_TOPICS} kinds to skip")
    elif isinstance(frame, Gossip):
        if not valid_topic(frame.topic) or len(frame.kind) > 32:
            raise ProtocolViolation("gossip frame: malformed topic or kind")
    elif isinstance(frame, Have | Want):
        if len(frame.ids) > MAX_IDS or any(len(i) != ID_BYTES for i in frame.ids):
            name = "have" if isinstance(frame, Have) else "want"
            raise ProtocolViolation(f"{name} frame: at most {MAX_IDS} ids of {ID_BYTES} bytes each")
    elif isinstance(frame, RelayRequest):
        if frame.method not in ("GET", "HEAD") or len(frame.path) > 512:
            raise ProtocolViolation("relay request: only GET/HEAD of a short path")
        if frame.range is not None and len(frame.range) > 128:
            raise ProtocolViolation("relay request: range header too long")
    elif isinstance(frame, RelayHead):
        if not 100 <= frame.status <= 599 or len(frame.headers) > MAX_RELAY_HEADERS:
            raise ProtocolViolation("relay head: bad status or too many headers")
        if any(len(k) > 64 or len(v) > 512 for k, v in frame.headers.items()):
            raise ProtocolViolation("relay head: header too long")
    elif isinstance(frame, Bye) and len(frame.reason) > 512:
        raise ProtocolViolation("bye frame: reason too long")
