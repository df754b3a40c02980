"""What members say to each other on their control endpoints: frames and bodies.

A connection carries four frames (:mod:`p2ptrain.cluster.proof` says why in this order):
:class:`Hello`, :class:`Challenge`, then a :class:`Signed` request and a :class:`Signed`
answer, or a :class:`Refused`. Each frame is a 4-byte big-endian length and that many bytes
of msgpack, at most :data:`MAX_FRAME_BYTES`. A signed body is a :data:`Request` or a
:data:`Reply`, msgpack too, and travels only inside a :class:`Signed` frame.

Decoding peer bytes raises :class:`~p2ptrain.errors.ProtocolViolation` and nothing else.
"""

from __future__ import annotations

import struct
from typing import TypeVar

import msgspec

from p2ptrain.cluster.membership import GenerationPlan, Member
from p2ptrain.errors import ProtocolViolation

__all__ = [
    "MAX_FRAME_BYTES",
    "Challenge",
    "Formed",
    "Frame",
    "Hello",
    "Incompatible",
    "JoinRequest",
    "MemberInfo",
    "NotLeader",
    "Refused",
    "Reply",
    "Request",
    "Signed",
    "StatusReply",
    "StatusRequest",
    "Wait",
    "decode_frame",
    "decode_reply",
    "decode_request",
    "encode_body",
    "frame_bytes",
    "frame_length",
]

MAX_FRAME_BYTES = 64 * 1024
_LENGTH = struct.Struct(">I")
_MAX_KNOWN = 256  # addresses a member passes on in one body
T = TypeVar("T")


class _Record(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class MemberInfo(_Record, frozen=True):
    """A member's account of itself, sent with every request and status."""

    peer_id: str
    address: str
    since: int | None
    completed_step: int
    generation: int
    #: SHA-256 of what it trains (workload, config, seed, compression): only equals join.
    settings: str
    #: Its workload is built and it can train.
    ready: bool
    #: Whom it follows now (itself when it leads); None while it does not know.
    leader: str | None
    training: bool

    def member(self) -> Member:
        return Member(self.peer_id, self.address, self.since, self.completed_step, self.generation)


# -- handshake frames ------------------------------------------------------------------------


class Hello(_Record, tag="hello", frozen=True):
    cluster_id: str
    public_key: bytes
    nonce: bytes


class Challenge(_Record, tag="challenge", frozen=True):
    public_key: bytes
    nonce: bytes


class Signed(_Record, tag="signed", frozen=True):
    body: bytes
    secret_mac: bytes
    signature: bytes


class Refused(_Record, tag="refused", frozen=True):
    reason: str


Frame = Hello | Challenge | Signed | Refused

# -- bodies ----------------------------------------------------------------------------------


class StatusRequest(_Record, tag="status", frozen=True):
    member: MemberInfo
    known: tuple[str, ...] = ()


class JoinRequest(_Record, tag="join", frozen=True):
    member: MemberInfo
    known: tuple[str, ...] = ()


Request = StatusRequest | JoinRequest


class StatusReply(_Record, tag="status", frozen=True):
    member: MemberInfo
    #: Control addresses of the members it knows, so that views converge.
    known: tuple[str, ...] = ()


class Wait(_Record, tag="wait", frozen=True):
    reason: str


class NotLeader(_Record, tag="not_leader", frozen=True):
    #: The control address of the member it follows (None: it does not know yet).
    leader: str | None
    reason: str


class Formed(_Record, tag="formed", frozen=True):
    plan: GenerationPlan
    rank: int


class Incompatible(_Record, tag="incompatible", frozen=True):
    reason: str


Reply = StatusReply | Wait | NotLeader | Formed | Incompatible

_encoder = msgspec.msgpack.Encoder()
_frames = msgspec.msgpack.Decoder(Frame)
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


def frame_bytes(frame: Frame) -> bytes:
    """``frame`` with its length in front, ready to write."""
    payload = _encoder.encode(frame)
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"a {type(frame).__name__} frame of {len(payload)} bytes is too large")
    return _LENGTH.pack(len(payload)) + payload


def frame_length(header: bytes) -> int:
    """The length a 4-byte frame header announces; ProtocolViolation when too large."""
    (length,) = _LENGTH.unpack(header)
    if not 0 < length <= MAX_FRAME_BYTES:
        raise ProtocolViolation(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return int(length)


def _decoded(decoder: msgspec.msgpack.Decoder[T], data: bytes, what: str) -> T:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise ProtocolViolation(f"a malformed {what}: {exc}") from None


def decode_frame(data: bytes) -> Frame:
    frame: Frame = _decoded(_frames, data, "frame")
    return frame


def encode_body(body: Request | Reply) -> bytes:
    if isinstance(body, StatusRequest | JoinRequest | StatusReply) and len(body.known) > _MAX_KNOWN:
        body = msgspec.structs.replace(body, known=body.known[:_MAX_KNOWN])
    return _encoder.encode(body)


def decode_request(data: bytes) -> Request:
    request: Request = _decoded(_requests, data, "request")
    return request


def decode_reply(data: bytes) -> Reply:
    reply: Reply = _decoded(_replies, data, "reply")
    return reply
