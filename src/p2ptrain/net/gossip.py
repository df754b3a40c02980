"""Gossip of signed records over the node's peer connections: bodies once, ids to the rest.

A message is ``(topic, kind, data)``: ``data`` is a signed envelope of ``kind`` (or a quorum
certificate); its id is the first 16 bytes of the SHA-256 of ``data``. Its publisher sends
the body to every neighbour subscribed to the topic. A node that receives a body it had not
seen verifies the signature, lets the topic's validator judge it, and only then passes it
on -- as its id: a ``Have`` frame to every subscribed neighbour but the ones known to hold
it. A neighbour that lacks the message asks for it (``Want``) from the first neighbour that
announced it, and from the next one if no body comes within ``want_timeout_s``. So each node
receives each body once, whatever the mesh shape, and a duplicate costs 16 bytes, not the
message; a forged or rejected message goes no further than the first honest node. (Flooding
bodies made every node receive each one from each neighbour: three quarters of a trainer's
gossip bytes.)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.core.certificate import CertifiedLink
from p2ptrain.core.encoding import decode
from p2ptrain.core.envelope import KINDS, Signed, open_envelope
from p2ptrain.errors import ProtocolViolation
from p2ptrain.net.config import NetConfig
from p2ptrain.net.connection import PeerConnection, SlowPeer
from p2ptrain.net.limits import SeenSet
from p2ptrain.net.wire import (
    ID_BYTES,
    MAX_IDS,
    Gossip,
    Have,
    Subscribe,
    Want,
    encode_frame,
    valid_topic,
)

__all__ = ["Delivered", "GossipRouter", "GossipStatistics", "Refusal", "message_id_of"]

logger = logging.getLogger(__name__)

CERTIFICATE_KIND = "certificate"
#: Kinds passed on as bodies, at once: a revocation closes the revoked peer's connections as
#: soon as a node applies it, and the revoked peer must have heard why before that (rare
#: and small, so the duplicates cost nothing).
_BODIES_AT_ONCE = frozenset({"revocation"})
#: Ids to announce wait this long, so that a burst of messages goes in one ``Have``.
_HAVE_BATCH_S = 0.005
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
    #: Gossip frames queued to peers (subscriptions, bodies, ids), in bytes.
    bytes_sent: int
    #: Ids announced to neighbours (``Have``), asked for (``Want``), and bodies sent to
    #: neighbours that asked.
    announced: int = 0
    wanted: int = 0
    served: int = 0


@dataclass(slots=True)
class _Wanted:
    """A message announced to us that we asked for: who else holds it, and the timer that
    asks the next one."""

    holders: deque[str]
    timer: asyncio.TimerHandle | None = None
    asked: set[str] = field(default_factory=set)


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
        self._bytes_sent = self._announced = self._wanted_count = self._served = 0
        #: Bodies we accepted, by id, to answer ``Want``: (topic, encoded ``Gossip`` frame),
        #: the newest ``body_cache_bytes`` of them.
        self._bodies: OrderedDict[bytes, tuple[str, bytes]] = OrderedDict()
        self._body_bytes = 0
        #: Messages announced to us that we asked for and still wait for.
        self._wants: dict[bytes, _Wanted] = {}
        #: Ids to announce, per neighbour, sent together once the current step is done.
        self._haves: dict[str, list[bytes]] = {}
        self._flushing = False
        #: Ids each connection was sent the body of on request: asked once, served once.
        self._served_to: weakref.WeakKeyDictionary[PeerConnection, set[bytes]] = (
            weakref.WeakKeyDictionary()
        )

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
        frame = self.hello()
        for connection in list(self.connections.values()):
            self._send(connection, frame)

    def hello(self) -> bytes:
        """The first frame on a new connection: our subscriptions, and what we skip."""
        return encode_frame(Subscribe(self.topics, sorted(self._config.gossip_skip)))

    # -- messages -------------------------------------------------------------------------

    def publish(self, topic: str, kind: str, data: bytes, *, again: bool = False) -> bool:
        """Flood our own message. Returns False when it was already seen -- unless
        ``again``: a message sent before (lost to a crash or a partition) goes to every
        neighbour once more (theirs drop it if they have it). Raises ProtocolViolation if it
        would not pass our own checks (a bug on our side)."""
        message_id = message_id_of(data)
        if self._seen.seen(message_id, time.monotonic()):
            if not again:
                return False
            self._push(Gossip(topic, kind, data))
            return True
        delivered = Delivered(topic, kind, data, _verify(kind, data), from_peer="")
        self._seen.add(message_id, time.monotonic())
        self._published += 1
        self._keep(message_id, topic, encode_frame(Gossip(topic, kind, data)))
        self._push(Gossip(topic, kind, data))
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

    def receive(self, connection: PeerConnection, frame: Gossip | Subscribe | Have | Want) -> None:
        """Handle one gossip-plane frame from a peer."""
        if isinstance(frame, Subscribe):
            connection.topics = frozenset(frame.topics)
            connection.skip = frozenset(frame.skip)
            return
        if isinstance(frame, Have):
            self._announced_to_us(connection, frame.ids)
            return
        if isinstance(frame, Want):
            self._serve_wants(connection, frame.ids)
            return
        if frame.topic not in self._handlers or frame.kind in self._config.gossip_skip:
            self._unwanted += 1
            return
        message_id = message_id_of(frame.data)
        wanted = self._wants.pop(message_id, None)
        if wanted is not None and wanted.timer is not None:
            wanted.timer.cancel()
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
        self._keep(message_id, frame.topic, encode_frame(frame))
        holders = {connection.peer_id, *(() if wanted is None else wanted.holders)}
        if wanted is not None:
            holders |= wanted.asked
        if frame.kind in _BODIES_AT_ONCE:
            self._push(frame, skip=holders)
        else:
            self._announce(message_id, frame.topic, frame.kind, holders)
        self._delivered += 1
        for handler in self._handlers[frame.topic]:
            try:
                handler(delivered)
            except Exception:  # a handler's bug must not break the router
                logger.exception("gossip handler for %s failed", frame.topic)

    def _push(self, frame: Gossip, skip: Iterable[str] = ()) -> None:
        """The body to every subscribed neighbour that takes its kind (but ``skip``)."""
        data = encode_frame(frame)
        left_out = set(skip)
        for peer_id, connection in list(self.connections.items()):
            if peer_id in left_out or not _takes(connection, frame.topic, frame.kind):
                continue
            if self._send(connection, data):
                self._forwarded += 1

    # -- ids and bodies -------------------------------------------------------------------

    def _keep(self, message_id: bytes, topic: str, frame: bytes) -> None:
        """Keep an accepted message's body for neighbours that will ask for it."""
        if message_id in self._bodies:
            return
        self._bodies[message_id] = (topic, frame)
        self._body_bytes += len(frame)
        while self._body_bytes > self._config.body_cache_bytes and self._bodies:
            _, (_, dropped) = self._bodies.popitem(last=False)
            self._body_bytes -= len(dropped)

    def _announce(self, message_id: bytes, topic: str, kind: str, holders: Iterable[str]) -> None:
        """Tell every subscribed neighbour but ``holders`` that we hold the message."""
        skip = set(holders)
        for peer_id, connection in list(self.connections.items()):
            if peer_id in skip or not _takes(connection, topic, kind):
                continue
            self._haves.setdefault(peer_id, []).append(message_id)
            self._announced += 1
            self._forwarded += 1
        if self._haves and not self._flushing:
            self._flushing = True
            try:
                asyncio.get_running_loop().call_later(_HAVE_BATCH_S, self._flush_haves)
            except RuntimeError:  # no loop (tests of the router alone): at once
                self._flush_haves()

    def _flush_haves(self) -> None:
        self._flushing = False
        haves, self._haves = self._haves, {}
        for peer_id, ids in haves.items():
            connection = self.connections.get(peer_id)
            if connection is None:
                continue
            for start in range(0, len(ids), MAX_IDS):
                if not self._send(connection, encode_frame(Have(ids[start : start + MAX_IDS]))):
                    break

    def _announced_to_us(self, connection: PeerConnection, ids: list[bytes]) -> None:
        """Ask ``connection`` for the announced messages we lack and nobody is sending."""
        now = time.monotonic()
        ask: list[bytes] = []
        for message_id in ids:
            if self._seen.seen(message_id, now):
                continue
            wanted = self._wants.get(message_id)
            if wanted is not None:
                if connection.peer_id not in wanted.holders:
                    wanted.holders.append(connection.peer_id)
                continue
            if len(self._wants) >= self._config.seen_entries:
                continue  # a flood of made-up ids: the real ones come again by resync
            self._wants[message_id] = _Wanted(deque())
            self._ask(message_id, connection)
            ask.append(message_id)
        if ask:
            self._wanted_count += len(ask)
            self._send(connection, encode_frame(Want(ask)))

    def _ask(self, message_id: bytes, connection: PeerConnection) -> None:
        """Note that ``connection`` was asked for the message, and when to ask another."""
        wanted = self._wants[message_id]
        wanted.asked.add(connection.peer_id)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop, no timers: a router driven by hand
        wanted.timer = loop.call_later(self._config.want_timeout_s, self._ask_next, message_id)

    def _ask_next(self, message_id: bytes) -> None:
        """No body came in time: ask the next neighbour that announced it (a slow or lost
        connection is a transport fault, counted against nobody)."""
        wanted = self._wants.get(message_id)
        if wanted is None:
            return
        while wanted.holders:
            connection = self.connections.get(wanted.holders.popleft())
            if connection is None or connection.closed:
                continue
            self._ask(message_id, connection)
            self._wanted_count += 1
            self._send(connection, encode_frame(Want([message_id])))
            return
        del self._wants[message_id]  # nobody left: a later announcement asks again

    def _serve_wants(self, connection: PeerConnection, ids: list[bytes]) -> None:
        """Send the bodies asked for that we hold, each at most once on this connection."""
        served = self._served_to.setdefault(connection, set())
        for message_id in ids:
            body = self._bodies.get(message_id)
            if body is None or message_id in served:
                continue
            if len(served) >= self._config.seen_entries:
                served.clear()
            served.add(message_id)
            if not self._send(connection, body[1]):
                return
            self._served += 1

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
            announced=self._announced,
            wanted=self._wanted_count,
            served=self._served,
        )


def _takes(connection: PeerConnection, topic: str, kind: str) -> bool:
    return topic in connection.topics and kind not in connection.skip


def message_id_of(data: bytes) -> bytes:
    """A message's id: the first 16 bytes of the SHA-256 of its ``data`` (finding a second
    message with a given id costs 2^128 hashes)."""
    return hashlib.sha256(data).digest()[:ID_BYTES]


def _verify(kind: str, data: bytes) -> Signed[Any] | CertifiedLink:
    if kind == CERTIFICATE_KIND:
        return decode(CertifiedLink, data, max_bytes=_MAX_CERTIFICATE_BYTES)
    record_kind = KINDS.get(kind)
    if record_kind is None:
        raise ProtocolViolation(f"unknown record kind {kind[:32]!r}")
    return open_envelope(data, record_kind.type)
