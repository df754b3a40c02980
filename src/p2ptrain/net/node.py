"""A node's network presence: server, gossip connections, discovery and relay, in one owner.

``async with NetNode(...) as node:`` starts the HTTP server (unless ``config.host`` is
None), dials the bootstrap seeds, and keeps looking for peers; every background task belongs
to the node's task group and ends when the node stops. The node's own signed peer record
says how to reach it: its address when it listens, its relay seed when it does not but wants
to be reachable, or nothing (an outbound-only trainer or viewer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from aiohttp import web
from prometheus_client.core import Metric

from p2ptrain.core.envelope import Signed, seal
from p2ptrain.core.identity import Identity, peer_id_of
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.core.records import AdmissionCertificate, PeerRecord, Revocation
from p2ptrain.errors import ProtocolViolation, TransportError
from p2ptrain.net.auth import Admitted, ClientCredentials, Gatekeeper
from p2ptrain.net.client import PeerClient, Refused
from p2ptrain.net.config import NetConfig
from p2ptrain.net.connection import PeerConnection
from p2ptrain.net.content import Answer, LocalContent
from p2ptrain.net.gossip import Delivered, GossipRouter, GossipStatistics, Refusal
from p2ptrain.net.net_metrics import exposition, net_families
from p2ptrain.net.peers import PeerBook, PeerBookStatistics
from p2ptrain.net.relay import RelayHub, RelayStatistics, answer_relay
from p2ptrain.net.server import NodeServer, ServerStatistics
from p2ptrain.net.tls import SelfSignedCertificate
from p2ptrain.net.wire import (
    Bye,
    Gossip,
    Have,
    RelayChunk,
    RelayHead,
    RelayRequest,
    Subscribe,
    Want,
    decode_frame,
    encode_frame,
)
from p2ptrain.protocol.chain import HeadChain
from p2ptrain.store.blobs import BlobStore

__all__ = ["NetNode", "NetNodeStatistics", "network_topic"]

logger = logging.getLogger(__name__)

_RELAY_ANSWERS_PER_CONNECTION = 8
_DIAL_BACKOFF_S = (1.0, 2.0, 5.0, 15.0, 60.0)
#: With all the outbound connections it wants, a node still asks a neighbour for peer
#: records every this many discovery rounds.
_PEX_EVERY_ROUNDS = 15


def network_topic(network_id: str) -> str:
    return f"net/{network_id}"


@dataclass(frozen=True, slots=True)
class NetNodeStatistics:
    peer_id: str
    address: str | None
    outbound: int
    inbound: int
    #: Connections registered since start (churn shows as this growing while idle).
    connections_opened: int
    gossip: GossipStatistics
    peers: PeerBookStatistics
    relay: RelayStatistics
    server: ServerStatistics | None
    #: Bytes of gossip and subscription frames read from neighbours.
    gossip_bytes_received: int = 0


class NetNode:
    """One node on the network. See the module docstring."""

    def __init__(
        self,
        *,
        identity: Identity,
        network: NetworkManifest,
        blobs: BlobStore,
        config: NetConfig | None = None,
        roles: Sequence[str] = ("seed",),
        secret: bytes | None = None,
        admission: Signed[AdmissionCertificate] | None = None,
        relay: str | None = None,
        rng: random.Random | None = None,
        answers: Mapping[str, Callable[[str], Answer]] | None = None,
        on_blob_bytes: Callable[[str, str, int], None] | None = None,
        extra_routes: Sequence[web.RouteDef] = (),
        metrics_text: Callable[[], bytes] | None = None,
        on_revoked: Callable[[Signed[Revocation]], None] | None = None,
    ) -> None:
        """``answers``: the node's own content answers by path prefix (its records, status);
        ``on_blob_bytes``: told of each blob served (``sent``) or pushed here (``received``),
        with its id and bytes; ``extra_routes``: the node's own pages (the dashboard; see
        the server); ``metrics_text``: the Prometheus text of ``/metrics`` (else the
        network's alone); ``on_revoked``: told of each revocation new to this node (once
        the peer is cut off), to keep it."""
        self.config = config or NetConfig()
        self.identity = identity
        self.network = network
        self.network_id = network.id
        self.peer_id = identity.peer_id
        self.blobs = blobs
        self.roles = tuple(sorted(set(roles)))
        self.relay_address = relay
        self._rng = rng or random.Random()
        now_ms: Callable[[], int] = lambda: int(time.time() * 1000)  # noqa: E731
        self._now_ms = now_ms
        self.gatekeeper = Gatekeeper(network, identity, secret=secret, now_ms=now_ms)
        self.client = PeerClient(
            ClientCredentials(network, identity, secret=secret, admission=admission),
            timeout_s=self.config.request_timeout_s,
        )
        self.peers = PeerBook(
            self.network_id,
            self_id=self.peer_id,
            strikes_to_ban=self.config.strikes_to_ban,
            ban_s=self.config.ban_s,
            strike_decay_s=self.config.strike_decay_s,
        )
        self.gossip = GossipRouter(self.config, strike=self.strike, drop=self._drop_slow)
        self._connected = asyncio.Event()
        self.relay = RelayHub(self.config.request_timeout_s)
        self._record: Signed[PeerRecord] | None = None
        self.content = LocalContent(blobs, self.peers, self.self_record)
        self.content.handlers.update(answers or {})
        self.gossip.subscribe(
            network_topic(self.network_id), self._on_peer_record, self._check_peer_record
        )
        for topic in self.config.topics:
            self.gossip.subscribe(topic, lambda _: None)
        #: Verified revocations by revoked key: passed to every peer we connect to.
        self.revocations: dict[bytes, Signed[Revocation]] = {}
        self.on_revoked = on_revoked or (lambda _: None)
        self.address: str | None = None
        self.port = 0  # the port we listen on, once started
        self._server: NodeServer | None = None
        self._runner: web.AppRunner | None = None
        self._tls: SelfSignedCertificate | None = None
        self._group: asyncio.TaskGroup | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._dialing: set[str] = set()
        self._failures: dict[str, tuple[int, float]] = {}
        self._peer_at: dict[str, str] = {}  # address -> the peer id it proved last time
        self._rounds = 0
        self._opened = 0
        self._lan: Any = None
        self._gossip_in = 0
        #: peer id -> when a new record of it last reached us (its presence; bounded by the
        #: peer book, which only keeps verified records)
        self._heard_at: dict[str, float] = {}
        #: Whether a bootstrap was linked when last looked at (None: none was ever linked).
        self._bootstrap_linked: bool | None = None
        self.on_blob_bytes: Callable[[str, str, int], None] = on_blob_bytes or (lambda *_: None)
        self.extra_routes = tuple(extra_routes)
        self.metrics_text: Callable[[], bytes] = metrics_text or (
            lambda: exposition(self.metric_families)
        )

    # -- life cycle -----------------------------------------------------------------------

    async def __aenter__(self) -> NetNode:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self.config.host is not None:
            await self._listen(self.config.host)
        self._record = self._sign_record()
        started = asyncio.Event()
        self._supervisor = asyncio.create_task(self._supervise(started), name="net-node")
        await started.wait()
        if self.config.mdns:
            await self._start_lan()
        where = self.address or (f"relayed by {self.relay_address}" if self.relay_address else "")
        logger.info("node %s up %s", self.peer_id[:16], where or "(outbound only)")

    async def stop(self) -> None:
        self._stopping.set()
        # at once: each close waits for its peer's answer (a stopped peer's for 2 s)
        await asyncio.gather(
            *(
                connection.close("node stopping", code=aiohttp.WSCloseCode.GOING_AWAY)
                for connection in list(self.gossip.connections.values())
            )
        )
        if self._lan is not None:
            await self._lan.stop()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        if self._runner is not None:
            await self._runner.cleanup()
        await self.client.close()
        if self._tls is not None:
            self._tls.remove()

    async def _supervise(self, started: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            group.create_task(self._discover_forever(), name="discovery")
            group.create_task(self._announce_forever(), name="presence")
            started.set()
            await self._stopping.wait()
            raise asyncio.CancelledError

    def spawn(self, coroutine: Any, name: str) -> None:
        """Run a background task owned by this node (it ends when the node stops)."""
        if self._group is None or self._stopping.is_set():
            coroutine.close()
            return
        self._group.create_task(_logged(coroutine, name), name=name)

    async def _listen(self, host: str) -> None:
        self._server = NodeServer(
            self.config,
            gatekeeper=self.gatekeeper,
            content=self.content,
            peers=self.peers,
            relay=self.relay,
            connection_to=self.gossip.connections.get,
            on_socket=self._inbound_socket,
            inbound_full=lambda: self._count(outbound=False) >= self.config.max_inbound,
            metrics=self.metrics_text,
            on_blob_bytes=self.on_blob_bytes,
            extra_routes=self.extra_routes,
        )
        context: ssl.SSLContext | None = None
        if self.config.tls:
            if self.config.tls_dir is not None:
                self._tls = SelfSignedCertificate.kept_in(self.config.tls_dir, host)
            else:
                self._tls = SelfSignedCertificate.generate(host)
            context = self._tls.server_context()
        self._runner = web.AppRunner(
            self._server.application(), access_log=None, handle_signals=False
        )
        await self._runner.setup()
        port = self.config.port or self.config.preferred_port
        site = web.TCPSite(self._runner, host, port, ssl_context=context)
        try:
            await site.start()
        except OSError as exc:
            if self.config.port or not port:
                raise
            logger.info("port %d of the last run is taken (%s): listening on a free one", port, exc)
            site = web.TCPSite(self._runner, host, 0, ssl_context=context)
            await site.start()
        self.port = int(self._runner.addresses[0][1])
        scheme = "https" if context else "http"
        self.address = f"{scheme}://{host}:{self.port}{self._pin()}"

    def _pin(self) -> str:
        """The address fragment that pins our TLS certificate ("" without TLS)."""
        return f"#sha256={self._tls.fingerprint}" if self._tls else ""

    async def _start_lan(self) -> None:
        from p2ptrain.net.mdns import LanDiscovery

        self._lan = LanDiscovery(
            network_id=self.network_id,
            peer_id=self.peer_id,
            port=self.port,
            tls=self._tls is not None,
            on_found=lambda peer: self.spawn(
                self.connect(peer.address, expect=peer.peer_id), "lan-dial"
            ),
        )
        await self._lan.start()

    # -- our record -----------------------------------------------------------------------

    def _sign_record(self) -> Signed[PeerRecord]:
        advertised = tuple(
            _with_port(a, self.port) + ("" if "#" in a else self._pin())
            for a in self.config.advertise
        )
        addresses = advertised or ((self.address,) if self.address else ())
        if addresses:
            reachability, relay = "public", None
        elif self.relay_address is not None:
            reachability, relay = "relayed", self.relay_address
        else:
            reachability, relay = "outbound", None
        record = PeerRecord(
            network_id=self.network_id,
            public_key=self.identity.public_key,
            seq=self._now_ms(),
            roles=self.roles,
            reachability=reachability,
            addresses=tuple(addresses),
            relay=relay,
            tls_fingerprint=None if self._tls is None else self._tls.fingerprint,
            issued_at_ms=self._now_ms(),
        )
        return seal(self.identity, record)

    def self_record(self) -> Signed[PeerRecord]:
        if self._record is None:
            self._record = self._sign_record()
        return self._record

    def address_of(self, peer_id: str) -> str | None:
        """Where to send requests for ``peer_id``: its own address, or the path through
        its relay seed; None for an outbound-only peer."""
        if peer_id == self.peer_id:
            return self.address
        signed = self.peers.get(peer_id)
        if signed is None:
            return None
        record = signed.record
        if record.addresses:
            return record.addresses[0]
        if record.relay is not None:
            return f"{record.relay.split('#')[0].rstrip('/')}/v1/relay/{peer_id}"
        return None

    def _check_peer_record(self, message: Delivered) -> str | Refusal | None:
        """The network topic's validator: peer records and revocations of this network."""
        if message.kind not in ("peer", "revocation") or not isinstance(message.record, Signed):
            return "only peer records and revocations travel on the network topic"
        record = message.record.record
        if isinstance(record, Revocation):
            return self.revocation_problem(record)
        if not isinstance(record, PeerRecord) or record.network_id != self.network_id:
            return "peer record for another network"
        if record.public_key in self.gatekeeper.revoked:
            # whoever forwarded it may not have heard of the revocation yet: no one's fault
            return Refusal(f"peer {record.peer_id[:16]}'s admission was revoked")
        certificate = self.gatekeeper.certificate_of(record.public_key)
        if certificate is not None and not certificate.allows(record.roles):
            return Refusal(
                f"peer {record.peer_id[:16]} announces roles {'+'.join(record.roles)}, but "
                f"its admission certificate allows {'+'.join(certificate.roles)}",
                blame=record.peer_id,
            )
        return None

    def revocation_problem(self, revocation: Revocation) -> str | None:
        """Why ``revocation`` (its signature verified) does not count here (None: it does)."""
        if revocation.network_id != self.network_id:
            return "revocation for another network"
        if revocation.issuer not in (*self.network.issuer_keys, self.network.authority):
            return "revocation signed by a key that is neither an issuer nor the authority"
        return None

    def _on_peer_record(self, message: Delivered) -> None:
        signed = message.record
        if not isinstance(signed, Signed):
            return
        if isinstance(signed.record, Revocation):
            self.revoke(signed)
        elif isinstance(signed.record, PeerRecord) and self.peers.add(signed):
            self._heard_at[signed.record.peer_id] = time.monotonic()

    def revoke(self, signed: Signed[Revocation]) -> bool:
        """Cut the revoked peer off: refuse its requests and records, close its
        connections, forget its record; True when the revocation was news. (Check it with
        :meth:`revocation_problem` first.)"""
        subject = signed.record.subject
        if subject in self.revocations:
            return False
        self.revocations[subject] = signed
        self.gatekeeper.revoked.add(subject)
        peer_id = peer_id_of(subject)
        self.peers.forget(peer_id)
        held = self.gossip.connections.get(peer_id)
        if held is not None:
            reason = f"admission revoked: {signed.record.reason or 'no reason given'}"
            self.spawn(held.close(reason, code=aiohttp.WSCloseCode.POLICY_VIOLATION), "revoked")
        logger.warning(
            "peer %s: admission revoked by %s (%s)",
            peer_id[:16], peer_id_of(signed.record.issuer)[:16], signed.record.reason or "-",
        )  # fmt: skip
        self.on_revoked(signed)
        return True

    def publish_revocation(self, signed: Signed[Revocation]) -> None:
        """Apply a revocation issued here and flood it."""
        self.revoke(signed)
        topic = network_topic(self.network_id)
        self.publish(topic, "revocation", signed.envelope.encode(), again=True)

    async def _announce_forever(self) -> None:
        """Every ``heartbeat_s``, sign our record anew and gossip it: our presence, by which
        the peers we are not connected to know we are alive (a reducer waits for the live
        trainers, not for the gone)."""
        while True:
            await asyncio.sleep(self.config.heartbeat_s * (0.9 + self._rng.random() / 5))
            self._record = self._sign_record()
            self.publish(network_topic(self.network_id), "peer", self._record.envelope.encode())

    def last_heard(self, peer_id: str, now: float) -> float | None:
        """When ``peer_id`` was last heard from: ``now`` while a connection to it is open,
        else when its newest record reached us (None: never)."""
        connection = self.gossip.connections.get(peer_id)
        if connection is not None and not connection.closed:
            return now
        return self._heard_at.get(peer_id)

    # -- connections ----------------------------------------------------------------------

    async def connect(self, address: str, *, expect: str | None = None) -> str:
        """Open a gossip connection to ``address``; return the peer id it proved. Raises
        Refused or TransportError; a connection already open to that peer is reused."""
        if address in self._dialing:
            raise TransportError(f"already dialing {address}")
        self._dialing.add(address)
        limit_s = 2 * self.config.connect_timeout_s  # the nonce, then the upgrade
        try:
            async with asyncio.timeout(limit_s):
                ws, peer_id = await self.client.open_socket(
                    address,
                    max_frame_bytes=self.config.max_frame_bytes,
                    timeout_s=self.config.connect_timeout_s,
                    heartbeat_s=self.config.heartbeat_s,
                )
        except TimeoutError:
            raise TransportError(f"{address} did not open a socket within {limit_s:g}s") from None
        finally:
            self._dialing.discard(address)
        self._peer_at[address] = peer_id
        if expect is not None and peer_id != expect:
            await ws.close()
            raise TransportError(f"{address} is peer {peer_id[:16]}, not {expect[:16]}")
        if peer_id == self.peer_id:
            await ws.close()
            raise TransportError(f"{address} is this node itself")
        connection = PeerConnection(ws, peer_id, outbound=True, remote=address, config=self.config)
        self.spawn(self._serve(connection), f"peer-{peer_id[:8]}")
        return peer_id

    async def _inbound_socket(self, ws: web.WebSocketResponse, who: Admitted, remote: str) -> None:
        connection = PeerConnection(
            ws, who.peer_id, outbound=False, remote=remote, config=self.config
        )
        await self._serve(connection)

    def _register(self, connection: PeerConnection) -> bool:
        held = self.gossip.connections.get(connection.peer_id)
        if held is not None and not held.closed:
            # Both sides keep the connection dialed by the lower peer id.
            we_are_lower = self.peer_id < connection.peer_id
            keep_new = connection.outbound == we_are_lower
            if not keep_new:
                return False
            self.spawn(held.close("duplicate connection"), "close-duplicate")
        self.gossip.connections[connection.peer_id] = connection
        self._opened += 1
        self._connected.set()
        return True

    async def wait_connected(self) -> None:
        """Return once at least one gossip connection is open."""
        while not any(not c.closed for c in self.gossip.connections.values()):
            self._connected.clear()
            await self._connected.wait()

    async def _serve(self, connection: PeerConnection) -> None:
        if not self._register(connection):
            await connection.close("duplicate connection")
            return
        relays = asyncio.Semaphore(_RELAY_ANSWERS_PER_CONNECTION)
        connection.send(self.gossip.hello())
        topic = network_topic(self.network_id)
        connection.send(encode_frame(Gossip(topic, "peer", self.self_record().envelope.encode())))
        for revocation in list(self.revocations.values()):  # a joiner learns them at once
            connection.send(encode_frame(Gossip(topic, "revocation", revocation.envelope.encode())))
        try:
            async with asyncio.TaskGroup() as group:
                writer = group.create_task(connection.write_loop())
                try:
                    await self._read(connection, group, relays)
                except ProtocolViolation as exc:
                    self.strike(connection.peer_id, str(exc))
                    await connection.close(str(exc), code=aiohttp.WSCloseCode.POLICY_VIOLATION)
                except (ConnectionError, aiohttp.ClientError, TimeoutError, TransportError) as exc:
                    # a transport fault: no strike (the peer may be paused or far away)
                    logger.info("connection to %s lost: %s", connection.peer_id[:16], exc)
                finally:
                    await connection.close(connection.close_reason or "done")
                    writer.cancel()
        finally:
            if self.gossip.connections.get(connection.peer_id) is connection:
                del self.gossip.connections[connection.peer_id]
            self.relay.disconnected(connection.peer_id)
            if self.config.bootstrap and not self._stopping.is_set():
                bootstraps = {self._peer_at.get(a) for a in self.config.bootstrap}
                self._say_bootstraps(any(p in self.gossip.connections for p in bootstraps))

    async def _read(
        self, connection: PeerConnection, group: asyncio.TaskGroup, relays: asyncio.Semaphore
    ) -> None:
        async for data in connection.frames():
            frame = decode_frame(data, max_bytes=self.config.max_frame_bytes)
            if isinstance(frame, Gossip | Subscribe | Have | Want):
                self._gossip_in += len(data)
                self.gossip.receive(connection, frame)
            elif isinstance(frame, RelayRequest):
                if relays.locked():
                    raise ProtocolViolation("too many relay requests at once")
                group.create_task(self._answer_relay(connection, frame, relays))
            elif isinstance(frame, RelayHead | RelayChunk):
                await self.relay.receive(connection, frame)
            elif isinstance(frame, Bye):
                connection.close_reason = f"peer left: {frame.reason[:200]}"
                logger.info("peer %s closed: %s", connection.peer_id[:16], frame.reason[:200])
                return

    async def _answer_relay(
        self, connection: PeerConnection, request: RelayRequest, relays: asyncio.Semaphore
    ) -> None:
        async with relays:
            try:
                await answer_relay(connection, request, self.content, self.config.request_timeout_s)
            except (OSError, TimeoutError) as exc:
                logger.info("relayed answer to %s failed: %r", connection.peer_id[:16], exc)

    def strike(self, peer_id: str, reason: str) -> None:
        """Count misbehaviour against ``peer_id`` (found here or by the node above: a bad
        update, a wrong proposal); enough strikes ban it."""
        now = time.monotonic()
        if self.peers.strike(peer_id, reason, now):
            held = self.gossip.connections.get(peer_id)
            if held is not None:
                self.spawn(
                    held.close(f"banned: {reason}", code=aiohttp.WSCloseCode.POLICY_VIOLATION),
                    "close-banned",
                )

    def _drop_slow(self, connection: PeerConnection, reason: str) -> None:
        self.spawn(connection.close(f"too slow: {reason}"), "close-slow")

    def _count(self, *, outbound: bool) -> int:
        return sum(1 for c in self.gossip.connections.values() if c.outbound == outbound)

    # -- discovery ------------------------------------------------------------------------

    async def _discover_forever(self) -> None:
        while True:
            try:
                await self.discover_once()
            except Exception:
                logger.exception("discovery round failed")
            await asyncio.sleep(self.config.discovery_interval_s * (0.75 + self._rng.random() / 2))

    async def discover_once(self) -> None:
        """Dial the seeds we are not connected to (and our relay, always), learn peers from
        one neighbour, and dial public peers until ``max_outbound`` connections are open."""
        now = time.monotonic()
        self._rounds += 1

        def linked(address: str) -> bool:
            peer_id = self._peer_at.get(address)
            return peer_id in self.gossip.connections or address == self.address

        room = self.config.max_outbound - self._count(outbound=True)
        seeds = [a for a in self.config.bootstrap if not linked(a)]
        self._say_bootstraps(len(seeds) < len(self.config.bootstrap))
        # A relayed node keeps its relay connection whatever its room.
        relay = (
            [self.relay_address] if self.relay_address and not linked(self.relay_address) else []
        )
        neighbours = [
            address
            for peer_id in self.gossip.connections
            if (address := self.address_of(peer_id)) is not None and "/v1/relay/" not in address
        ]
        if neighbours and (room > 0 or self._rounds % _PEX_EVERY_ROUNDS == 1):
            await self._learn_peers(self._rng.choice(neighbours))
        candidates = [
            address
            for signed in self.peers
            if signed.record.reachability == "public"
            and signed.record.peer_id not in self.gossip.connections
            and not self.peers.banned(signed.record.peer_id, now)
            for address in signed.record.addresses[:1]
            if address not in seeds and address not in relay
        ]
        self._rng.shuffle(candidates)
        dial = [a for a in seeds + candidates if self._may_dial(a, now)][: max(room, 0)]
        dial += [a for a in relay if self._may_dial(a, now) and a not in dial]
        if dial:
            await asyncio.gather(*(self._dial(a) for a in dial))

    def _say_bootstraps(self, linked: bool) -> None:
        """Say once when every bootstrap is lost, and once when one is back (before the
        first link, the join says what is wrong)."""
        was = self._bootstrap_linked
        if not self.config.bootstrap or linked == was or (was is None and not linked):
            return
        self._bootstrap_linked = linked
        if was is None:
            return
        if linked:
            logger.warning("a bootstrap is reachable again; back in touch with the network")
            return
        others = sum(1 for c in self.gossip.connections.values() if not c.closed)
        logger.warning(
            "lost every bootstrap (%s); going on with %d other peer connection(s) and dialing "
            "the bootstraps again (check that the seed is running)",
            ", ".join(self.config.bootstrap),
            others,
        )

    def _may_dial(self, address: str, now: float) -> bool:
        _failures, until = self._failures.get(address, (0, 0.0))
        return address not in self._dialing and now >= until

    async def _dial(self, address: str) -> None:
        try:
            await self.connect(address)
            self._failures.pop(address, None)
        except (Refused, TransportError, ProtocolViolation) as exc:
            failures, _ = self._failures.get(address, (0, 0.0))
            backoff = _DIAL_BACKOFF_S[min(failures, len(_DIAL_BACKOFF_S) - 1)]
            self._failures[address] = (failures + 1, time.monotonic() + backoff)
            level = logging.WARNING if isinstance(exc, Refused) else logging.INFO
            logger.log(level, "cannot connect to %s: %s", address, exc)

    async def _learn_peers(self, address: str) -> None:
        try:
            records = await self.client.peer_records(address)
        except (TransportError, ProtocolViolation) as exc:
            logger.info("peer exchange with %s failed: %s", address, exc)
            return
        for signed in records:
            try:
                self.peers.add(signed)
            except ProtocolViolation:
                continue

    # -- services for the node above ------------------------------------------------------

    def serve_chain(self, chain: HeadChain) -> None:
        """Answer ``GET /v1/heads/{experiment}`` from ``chain`` (late joiners catch up)."""
        self.content.chains[chain.experiment_id] = chain

    def publish(self, topic: str, kind: str, data: bytes, *, again: bool = False) -> bool:
        return self.gossip.publish(topic, kind, data, again=again)

    def statistics(self) -> NetNodeStatistics:
        return NetNodeStatistics(
            peer_id=self.peer_id,
            address=self.address,
            outbound=self._count(outbound=True),
            inbound=self._count(outbound=False),
            connections_opened=self._opened,
            gossip=self.gossip.statistics(),
            peers=self.peers.statistics(),
            relay=self.relay.statistics(),
            server=None if self._server is None else self._server.statistics(),
            gossip_bytes_received=self._gossip_in,
        )

    def metric_families(self) -> Iterator[Metric]:
        """The network's figures as typed Prometheus families."""
        return net_families(self.statistics())


def _with_port(address: str, port: int) -> str:
    """``address`` with our listening port when it names none (``http://10.0.0.5``)."""
    parts = urlsplit(address)
    if parts.port is not None or not port:
        return address
    return urlunsplit(parts._replace(netloc=f"{parts.netloc}:{port}"))


async def _logged(coroutine: Any, name: str) -> None:
    try:
        await coroutine
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("task %s failed", name)
