"""Flooding gossip of signed records over the node's peer connections.

A message is ``(topic, kind, data)``: ``data`` is a signed envelope of ``kind`` (or a quorum
certificate). A node forwards a message only after verifying its signature and the topic's
validator accepted it, only to connections subscribed to the topic, and only the first time
it sees it (a bounded, time-limited seen-set keyed by the SHA-256 of ``data``). Every
message therefore reaches each connected subscriber exactly once, whatever the mesh shape,
while a forged or rejected message goes no further than the first honest node.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2ptrain.core.certificate import CertifiedLink
from p2ptrain.core.encoding import decode
from p2ptrain.core.envelope import KINDS, Signed, open_envelope
from p2ptrain.errors import ProtocolViolation
from p2ptrain.net.config import NetConfig
from p2ptrain.net.connection import PeerConnection, SlowPeer
from p2ptrain.net.limits import SeenSet
from p2ptrain.net.wire import Gossip, Subscribe, encode_frame, valid_topic

__all__ = ["Delivered", "GossipRouter", "GossipStatistics", "Refusal"]

logger = logging.getLogger(__name__)

CERTIFICATE_KIND = "certificate"
_MAX_CERTIFICATE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Delivered:
    """A verified gossip message handed to the application."""

    topic: str
    kind: str
    data: bytes
    #: The verified envelope, or the (structurally valid) certified head: its certificate
    #: is checked by the topic's validator, which knows the experiment.
    record: Signed[Any] | CertifiedLink
    from_peer: str  # who forwarded it to us ("" when we published it)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A topic validator's refusal: the message is dropped and not forwarded, and counted
    against ``blame`` (a peer id) if given -- e.g. the signer of a record it had no right to
    sign -- or against nobody (a record the node cannot use yet, through no one's fault)."""

    reason: str
    blame: str | None = None


#: A topic validator returns None to accept, the reason the message is rejected (which
#: counts against the peer that forwarded it), or a :class:`Refusal` that says whom it
#: counts against.
Validator = Callable[[Delivered], str | Refusal | None]
Handler = Callable[[Delivered], None]


@dataclass(frozen=True, slots=True)
class GossipStatistics:
    connections: int
    topics: int
    published: int
    delivered: int
    forwarded: int
    duplicates: int
    rejected: int
    #: Refused without blame (e.g. records for windows far ahead of ours).
    ignored: int
    unwanted: int
    seen: int
    #: Gossip frames queued to peers (subscriptions, our messages, forwards), in bytes.
    bytes_sent: int


class GossipRouter:
    """Topics, the seen-set and forwarding; connections are added and removed by the node."""

    def __init__(
        self,
        config: NetConfig,
        *,
        strike: Callable[[str, str], None],
        drop: Callable[[PeerConnection, str], None],
    ) -> None:
        self._config = config
        self._strike = strike
        self._drop = drop
        self._seen = SeenSet(config.seen_entries, config.seen_ttl_s)
        self._handlers: dict[str, list[Handler]] = {}
        self._validators: dict[str, Validator] = {}
        #: Our own messages, for this node's handlers (see :meth:`_deliver_own`).
        self._own: deque[Delivered] = deque()
        self._delivering = False
        self.connections: dict[str, PeerConnection] = {}
        self._published = self._delivered = self._forwarded = 0
        self._duplicates = self._rejected = self._unwanted = self._ignored = 0
        self._bytes_sent = 0

    # -- topics ---------------------------------------------------------------------------

    @property
    def topics(self) -> list[str]:
        return sorted(self._handlers)

    def subscribe(self, topic: str, handler: Handler, validator: Validator | None = None) -> None:
        if not valid_topic(topic):
            raise ValueError(f"topic {topic!r} is not '<space>/<64-hex id>'")
        self._handlers.setdefault(topic, []).append(handler)
        if validator is not None:
            self._validators[topic] = validator
        frame = encode_frame(Subscribe(self.topics))
        for connection in list(self.connections.values()):
            self._send(connection, frame)

    def hello(self) -> bytes:
        """The first frame on a new connection: our subscriptions."""
        return encode_frame(Subscribe(self.topics))

    # -- messages -------------------------------------------------------------------------

    def publish(self, topic: str, kind: str, data: bytes, *, again: bool = False) -> bool:
        """Flood our own message. Returns False when it was already seen -- unless
        ``again``: a message sent before (lost to a crash or a partition) goes to every
        neighbour once more (theirs drop it if they have it). Raises ProtocolViolation if it
        would not pass our own checks (a bug on our side)."""
        message_id = hashlib.sha256(data).digest()
        if self._seen.seen(message_id, time.monotonic()):
            if not again:
                return False
            self._forward(Gossip(topic, kind, data), source=None)
            return True
        delivered = Delivered(topic, kind, data, _verify(kind, data), from_peer="")
        self._seen.add(message_id, time.monotonic())
        self._published += 1
        self._forward(Gossip(topic, kind, data), source=None)
        self._own.append(delivered)
        self._deliver_own()
        return True

    def _deliver_own(self) -> None:
        """Hand our own messages to this node's handlers once the code that published them
        has returned, in the order published, never from inside a handler: from the event
        loop when one runs here, else at the end of the outermost :meth:`publish`. A
        handler's publications wait for the handlers before them."""
        if self._delivering:
            return  # the delivery under way takes it
        self._delivering = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._drain_own()
        else:
            loop.call_soon(self._drain_own)

    def _drain_own(self) -> None:
        try:
            while self._own:
                delivered = self._own.popleft()
                for handler in self._handlers.get(delivered.topic, ()):
                    try:
                        handler(delivered)
                    except Exception:  # one handler's fault is not the others' (logged)
                        logger.exception("handling our own %s", delivered.kind)
        finally:
            self._delivering = False

    def receive(self, connection: PeerConnection, frame: Gossip | Subscribe) -> None:
        """Handle one gossip-plane frame from a peer."""
        if isinstance(frame, Subscribe):
            connection.topics = frozenset(frame.topics)
            return
        if frame.topic not in self._handlers:
            self._unwanted += 1
            return
        message_id = hashlib.sha256(frame.data).digest()
        if not self._seen.add(message_id, time.monotonic()):
            self._duplicates += 1
            return
        try:
            record = _verify(frame.kind, frame.data)
        except ProtocolViolation as exc:
            self._rejected += 1
            self._strike(connection.peer_id, f"gossip {frame.kind}: {exc}")
            return
        delivered = Delivered(frame.topic, frame.kind, frame.data, record, connection.peer_id)
        validator = self._validators.get(frame.topic)
        verdict = None if validator is None else validator(delivered)
        if isinstance(verdict, str):
            verdict = Refusal(verdict, blame=connection.peer_id)
        if verdict is not None:
            if verdict.blame is None:
                self._ignored += 1
                logger.debug("gossip %s ignored: %s", frame.kind, verdict.reason)
            else:
                self._rejected += 1
                self._strike(verdict.blame, f"gossip {frame.kind} rejected: {verdict.reason}")
            return
        self._forward(frame, source=connection)
        self._delivered += 1
        for handler in self._handlers[frame.topic]:
            try:
                handler(delivered)
            except Exception:  # a handler's bug must not break the router
                logger.exception("gossip handler for %s failed", frame.topic)

    def _forward(self, frame: Gossip, source: PeerConnection | None) -> None:
        data = encode_frame(frame)
        for connection in list(self.connections.values()):
            if connection is source or frame.topic not in connection.topics:
                continue
            if self._send(connection, data):
                self._forwarded += 1

    def _send(self, connection: PeerConnection, frame: bytes) -> bool:
        try:
            connection.send(frame)
        except SlowPeer as exc:
            self._drop(connection, str(exc))
            return False
        self._bytes_sent += len(frame)
        return True

    def statistics(self) -> GossipStatistics:
        return GossipStatistics(
            connections=len(self.connections),
            topics=len(self._handlers),
            published=self._published,
            delivered=self._delivered,
            forwarded=self._forwarded,
            duplicates=self._duplicates,
            rejected=self._rejected,
            ignored=self._ignored,
            unwanted=self._unwanted,
            seen=len(self._seen),
            bytes_sent=self._bytes_sent,
        )


def _verify(kind: str, data: bytes) -> Signed[Any] | CertifiedLink:
    if kind == CERTIFICATE_KIND:
        return decode(CertifiedLink, data, max_bytes=_MAX_CERTIFICATE_BYTES)
    record_kind = KINDS.get(kind)
    if record_kind is None:
        raise ProtocolViolation(f"unknown record kind {kind[:32]!r}")
    return open_envelope(data, record_kind.type)
