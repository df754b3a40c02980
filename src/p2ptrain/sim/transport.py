"""A simulated node's :class:`~p2ptrain.driver.transport.Transport` and
:class:`~p2ptrain.driver.transport.Keep`: the seam at which the simulator takes over from
the node's own code.

Above it, each simulated node runs the driver a real node runs (its runner, peer services,
provider order, hedged questions and blame); below it, a question to a peer is a message on
the virtual network (:class:`~.engine.Network`: latency, bandwidth, loss, partitions) and
its answer is served from that peer's in-memory keep. A question nobody answers in
:data:`ASK_TIMEOUT_S` is a transport fault, as a dropped connection is to a node. Blobs are
raced across their providers with :func:`~p2ptrain.driver.racing.hedged`, each answer
verified by its hash: a provider that serves other bytes is reported to the services
(``on_bad``), which blame it by its peer record.

What a node publishes leaves through the world's :class:`~.outbox.Outbox` (where an
adversary bends it); what a peer asks is answered by :meth:`SimTransport.answer`, the
node's server.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.core.certificate import CertifiedLink, QuorumCertificate
from p2ptrain.core.encoding import decode, sha256_hex
from p2ptrain.core.envelope import KINDS, open_envelope
from p2ptrain.core.records import Head
from p2ptrain.core.spool import SpooledBlob
from p2ptrain.driver.racing import hedged
from p2ptrain.driver.transport import ProviderNote
from p2ptrain.errors import LocalError, ProtocolViolation, TransportError
from p2ptrain.protocol.ballot import Ballot
from p2ptrain.protocol.chain import MAX_LINKS_PER_PAGE, HeadChain
from p2ptrain.protocol.effects import Publish
from p2ptrain.protocol.reduction import ByteSource, MemoryBytes
from p2ptrain.sim.engine import Network
from p2ptrain.sim.outbox import Outbox, Sender

__all__ = ["ANSWER", "ASK", "ASK_TIMEOUT_S", "SimKeep", "SimPeer", "SimTransport"]

#: The kinds of network message that carry a question and its answer:
#: ("ask", token, question, argument) and ("answer", token, answer).
ASK = "ask"
ANSWER = "answer"
#: A question nobody answered in this long failed in transit (its request or answer was lost).
ASK_TIMEOUT_S = 10.0
#: How long a blob provider may take before the next one is asked too.
BLOB_HEDGE_S = 2.0


class SimBlobs:
    """Blobs by hash, in memory (what survives a simulated crash: a node's store is on
    disk)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def has(self, blob_id: str) -> bool:
        return blob_id in self.data

    def get(self, blob_id: str) -> bytes:
        try:
            return self.data[blob_id]
        except KeyError:
            raise LocalError(f"blob {blob_id[:12]} is not kept") from None

    def reader(self, blob_id: str) -> ByteSource:
        return MemoryBytes(self.get(blob_id))

    def put(self, data: bytes | bytearray | memoryview) -> str:
        blob = bytes(data)
        blob_id = sha256_hex(blob)
        self.data[blob_id] = blob
        return blob_id

    def adopt(self, blob: SpooledBlob) -> str:
        return self.put(blob.read(0, len(blob)))


@dataclass
class SimKeep:
    """What a simulated node keeps: blobs, votes, and signed records by id and window."""

    blobs: SimBlobs = field(default_factory=SimBlobs)
    records: dict[str, bytes] = field(default_factory=dict)
    #: The kind and id of each record kept, by window (what a window sync is answered).
    by_window: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    votes: dict[int, Ballot] = field(default_factory=dict)

    def put_vote(self, height: int, ballot: Ballot) -> None:
        self.votes[height] = ballot

    def put_signed(
        self, record_id: str, kind: str, envelope: bytes, experiment_id: str, height: int
    ) -> None:
        if record_id not in self.records:
            self.by_window.setdefault(height, []).append((kind, record_id))
        self.records[record_id] = envelope

    def record(self, record_id: str) -> bytes | None:
        return self.records.get(record_id)

    def holds_state(self, head: Head) -> bool:
        return self.blobs.has(head.weights_blob) and (
            head.optimizer_blob is None or self.blobs.has(head.optimizer_blob)
        )


@dataclass(frozen=True, slots=True)
class SimPeer:
    """A simulated node as its peers know it: its address is its name."""

    name: str
    peer_id: str
    public_key: bytes
    roles: tuple[str, ...]

    @property
    def addresses(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True, slots=True)
class SimMessage:
    """A record that passed intake, as the driver's runner receives it."""

    kind: str
    data: bytes
    record: Any
    from_peer: str


@dataclass(frozen=True, slots=True)
class _Links:
    links: Sequence[tuple[Head, QuorumCertificate]]
    tip: int
    held: Sequence[int]


@dataclass(frozen=True, slots=True)
class _Window:
    updates: Sequence[str]
    proposals: Sequence[str]


@dataclass(frozen=True, slots=True)
class _Downloaded:
    seconds: float
    bytes_by_provider: dict[str, int]


class SimTransport:
    """One simulated node's network (see the module docstring). ``peers``: every node of
    the world by peer id; ``chain``: the node's certified chain (what it serves)."""

    def __init__(
        self,
        sender: Sender,
        *,
        net: Network,
        outbox: Outbox,
        keep: SimKeep,
        chain: Callable[[], HeadChain],
        peers: dict[str, SimPeer],
        roles: tuple[str, ...],
        now: Callable[[], float],
    ) -> None:
        self.sender = sender
        self.name = sender.name
        self._net = net
        self._outbox = outbox
        self.keep = keep
        self._chain = chain
        self._peers = peers
        self._by_name = {p.name: p for p in peers.values()}
        self._roles = roles
        self._now = now
        self._tokens = itertools.count(1)
        self._asked: dict[int, asyncio.Future[Any]] = {}
        #: Questions this node asked, by kind (what the node's own services did).
        self.asked: dict[str, int] = {}
        #: Each blob download: the providers asked, in order, and who delivered (None).
        self.downloads: list[tuple[str, tuple[str, ...], str | None]] = []
        self._serving = self._serves()

    # -- who is who -----------------------------------------------------------------------

    @property
    def address(self) -> str | None:
        return self.name

    @property
    def roles(self) -> Sequence[str]:
        return self._roles

    def known_peers(self) -> Iterator[SimPeer]:
        return (p for p in self._peers.values() if p.name != self.name)

    def peer_record(self, peer_id: str) -> SimPeer | None:
        return self._peers.get(peer_id)

    def address_of(self, peer_id: str) -> str | None:
        peer = self._peers.get(peer_id)
        return None if peer is None else peer.name

    def last_heard(self, peer_id: str, now: float) -> float | None:
        return None

    def strike(self, peer_id: str, reason: str) -> None:
        """Gossip scoring is the network layer's; the report itself is the observer's."""

    # -- publishing -----------------------------------------------------------------------

    def publish(self, topic: str, kind: str, data: bytes, *, again: bool = False) -> None:
        """The node's own bytes, opened again and handed to the outbox (an update goes with
        its blob, kept by the effect before)."""
        if kind == "certificate":
            record: Any = decode(CertifiedLink, data, max_bytes=len(data))
            blob = None
        else:
            record = open_envelope(data, KINDS[kind].type)
            blob_id = getattr(record.record, "delta_blob", None)
            blob = None if blob_id is None else self.keep.blobs.data.get(blob_id)
        self._outbox.publish(self.sender, Publish(kind, record, blob=blob, again=again))

    async def wait_connected(self) -> None:
        return None

    # -- asking one peer ------------------------------------------------------------------

    async def _ask(self, address: str, question: str, argument: Any) -> Any:
        """Send the question and wait for its answer (None: the peer holds nothing)."""
        if address not in self._by_name:
            raise TransportError(f"no simulated node at {address!r}")
        self.asked[question] = self.asked.get(question, 0) + 1
        token = next(self._tokens)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._asked[token] = future
        self._net.send(self.name, address, (ASK, token, question, argument), 128)
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                return await future
        except TimeoutError:
            raise TransportError(f"{address} did not answer within {ASK_TIMEOUT_S:g}s") from None
        finally:
            self._asked.pop(token, None)

    def answered(self, token: int, answer: Any) -> None:
        """An answer came back (a late one, after its question timed out, is dropped)."""
        future = self._asked.pop(token, None)
        if future is not None and not future.done():
            future.set_result(answer)

    async def head_links(self, address: str, experiment_id: str, after: int) -> _Links:
        answer = await self._ask(address, "links", after)
        if answer is None:
            return _Links((), 0, ())
        return _Links(*answer)

    async def window_records(self, address: str, experiment_id: str, window: int) -> _Window:
        answer = await self._ask(address, "window", window)
        updates = [i for k, i in answer or () if k == "update"]
        proposals = [i for k, i in answer or () if k == "proposal"]
        return _Window(updates, proposals)

    async def record(self, address: str, record_id: str) -> bytes:
        answer = await self._ask(address, "record", record_id)
        if answer is None:
            raise TransportError(f"{address} does not keep record {record_id[:12]}")
        assert isinstance(answer, bytes)
        return answer

    async def push_blob(self, address: str, blob_id: str) -> int:
        raise TransportError("every simulated node is reachable: nothing is pushed")

    async def download(
        self,
        blob_id: str,
        providers: Sequence[str],
        *,
        size: int | None,
        on_bad: ProviderNote,
        on_fault: ProviderNote,
        on_bytes: Callable[[int], None] | None = None,
    ) -> _Downloaded:
        """Race ``providers`` for the blob (hedged), each answer checked against its hash."""
        started = self._now()
        moved: dict[str, int] = {}
        proven_bad: list[str] = []
        asked: list[str] = []
        winner: list[str] = []

        async def ask(address: str) -> bytes | None:
            asked.append(address)
            try:
                blob = await self._ask(address, "blob", blob_id)
            except TransportError as exc:
                on_fault(address, str(exc))
                return None
            if blob is None:
                on_fault(address, f"does not hold blob {blob_id[:12]}")
                return None
            moved[address] = moved.get(address, 0) + len(blob)
            if on_bytes is not None:
                on_bytes(len(blob))
            if sha256_hex(blob) != blob_id:
                proven_bad.append(address)
                on_bad(address, f"blob {blob_id[:12]} hashed to {sha256_hex(blob)[:12]}")
                return None
            winner.append(address)
            return bytes(blob)

        try:
            blob = await hedged(
                providers, ask, on_timeout=on_fault, hedge_s=BLOB_HEDGE_S, answer_s=ASK_TIMEOUT_S
            )
        finally:
            self.downloads.append((blob_id, tuple(asked), winner[0] if winner else None))
        if blob is None:
            if proven_bad:
                raise ProtocolViolation(
                    f"no provider served blob {blob_id[:12]}; bad bytes from {proven_bad}"
                )
            raise TransportError(f"no provider of {len(providers)} delivered blob {blob_id[:12]}")
        self.keep.blobs.put(blob)
        return _Downloaded(self._now() - started, moved)

    # -- answering ------------------------------------------------------------------------

    def answer(self, asker: str, token: int, question: str, argument: Any) -> None:
        """Serve a peer's question from what this node keeps (None: it holds nothing; how,
        for each kind of question: :meth:`_serves`)."""
        answer, size = self._serving[question](argument)
        self._net.send(self.name, asker, (ANSWER, token, answer), 64 + size)

    def _serves(self) -> dict[str, Callable[[Any], tuple[Any, int]]]:
        """Each kind of question: its answer and the answer's size on the wire."""
        keep = self.keep
        return {
            "blob": lambda blob_id: _sized(self.serve_blob(blob_id)),
            "record": lambda record_id: _sized(keep.records.get(record_id)),
            "window": lambda window: (
                list(keep.by_window.get(window, ())),
                80 * len(keep.by_window.get(window, ())),
            ),
            "links": self._links_after,
        }

    def _links_after(self, height: int) -> tuple[Any, int]:
        chain = self._chain()
        links = chain.links_after(height)[:MAX_LINKS_PER_PAGE]
        if not links:
            return None, 0
        held = chain.held_heights(self.keep.holds_state)
        return (tuple(links), chain.height, tuple(sorted(held))), 1024 * len(links) + 8 * len(held)

    def serve_blob(self, blob_id: str) -> bytes | None:
        """The blob's bytes as this node serves them (an adversary overrides)."""
        return self.keep.blobs.data.get(blob_id)


def _sized(data: bytes | None) -> tuple[bytes | None, int]:
    return data, len(data or b"")


class LyingTransport(SimTransport):
    """A provider that serves every blob with its first byte flipped."""

    def serve_blob(self, blob_id: str) -> bytes | None:
        blob = super().serve_blob(blob_id)
        return None if not blob else bytes([blob[0] ^ 0xFF]) + blob[1:]
