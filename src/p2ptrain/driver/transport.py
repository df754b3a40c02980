"""The seam below the runner: what a node's roles need of a network and a store.

Everything in :mod:`p2ptrain.driver` -- the role runners, the peer services (whom to ask,
hedged questions, racing providers, blame) and the answers to each kind of fetch -- talks
to the world only through a :class:`Transport` and a :class:`Keep`. A real node gives it
its network and its data directory (:mod:`p2ptrain.node.transport`); the simulator gives
it a virtual network and in-memory stores (:mod:`p2ptrain.sim.transport`), so a seeded
simulation runs the same runner and services a node ships, the way ``trio.testing`` fakes
a network below unchanged application code.

A transport asks one peer (an address) one question and returns its answer unverified:
the caller opens, hashes and judges it, and blames the peer when it is proven bad. A
transport fault (no answer, a refused connection, a timeout) raises
:class:`~p2ptrain.errors.TransportError`; nonsense raises
:class:`~p2ptrain.errors.ProtocolViolation`. Only blobs go through one call for many
providers (:meth:`Transport.download`), because how a large blob is cut into ranges,
resumed and raced across providers is the transport's business; it reports each provider
proven to have served other bytes (``on_bad``) and each fault (``on_fault``), and the
services count them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from p2ptrain.core.certificate import CertifiedLink, QuorumCertificate
from p2ptrain.core.envelope import Signed
from p2ptrain.core.records import Head
from p2ptrain.core.spool import SpooledBlob
from p2ptrain.protocol.ballot import Ballot
from p2ptrain.protocol.reduction import ByteSource

__all__ = [
    "BlobKeep",
    "Downloaded",
    "Keep",
    "LinksAnswer",
    "Message",
    "Peer",
    "Transport",
    "WindowAnswer",
]

#: ``(address, reason)``: a provider that served bad bytes, or failed in transit.
ProviderNote = Callable[[str, str], None]


class Message(Protocol):
    """A record that passed the node's intake (gossip, or another role of the node)."""

    @property
    def kind(self) -> str: ...
    @property
    def data(self) -> bytes: ...
    @property
    def record(self) -> Signed[Any] | CertifiedLink: ...
    @property
    def from_peer(self) -> str:
        """The peer id that forwarded it ("": this node published it)."""
        ...


class Peer(Protocol):
    """What a node knows of a peer from its verified peer record."""

    @property
    def peer_id(self) -> str: ...
    @property
    def public_key(self) -> bytes: ...
    @property
    def roles(self) -> Sequence[str]: ...
    @property
    def addresses(self) -> Sequence[str]: ...


class LinksAnswer(Protocol):
    """A page of certified heads above a height, as a peer tells them (unverified)."""

    @property
    def links(self) -> Sequence[tuple[Head, QuorumCertificate]]: ...
    @property
    def tip(self) -> int: ...
    @property
    def held(self) -> Sequence[int]: ...


class WindowAnswer(Protocol):
    """The ids of the updates and proposals of a window a peer keeps (checked for form)."""

    @property
    def updates(self) -> Sequence[str]: ...
    @property
    def proposals(self) -> Sequence[str]: ...


class Downloaded(Protocol):
    """What one blob download took."""

    @property
    def seconds(self) -> float: ...
    @property
    def bytes_by_provider(self) -> dict[str, int]: ...


class BlobKeep(Protocol):
    """Blobs by their SHA-256 (hex)."""

    def has(self, blob_id: str) -> bool: ...
    def get(self, blob_id: str) -> bytes | bytearray: ...
    def reader(self, blob_id: str) -> ByteSource:
        """The kept blob, read by range (a reduction reads one window of it at a time)."""
        ...

    def put(self, data: bytes | bytearray | memoryview) -> str: ...
    def adopt(self, blob: SpooledBlob) -> str:
        """Keep a blob spooled to a file (moving the file, where the keep is one)."""
        ...


class Keep(Protocol):
    """What a node keeps: blobs, its votes, and the signed records it serves."""

    @property
    def blobs(self) -> BlobKeep: ...
    def put_vote(self, height: int, ballot: Ballot) -> None: ...
    def put_signed(
        self, record_id: str, kind: str, envelope: bytes, experiment_id: str, height: int
    ) -> None: ...
    def record(self, record_id: str) -> bytes | None: ...


class Transport(Protocol):
    """One node's view of the network."""

    @property
    def address(self) -> str | None:
        """Where peers reach this node (None: it is outbound only)."""
        ...

    @property
    def roles(self) -> Sequence[str]:
        """This node's roles, as its peer record says."""
        ...

    def known_peers(self) -> Iterable[Peer]:
        """The verified records of the peers this node knows."""
        ...

    def peer_record(self, peer_id: str) -> Peer | None:
        """The verified record of ``peer_id``, if this node knows the peer."""
        ...

    def address_of(self, peer_id: str) -> str | None: ...

    def last_heard(self, peer_id: str, now: float) -> float | None:
        """When (on the node's clock) the peer was last heard from, if ever."""
        ...

    def strike(self, peer_id: str, reason: str) -> None:
        """Count proven misbehaviour against the peer (gossip scores it)."""
        ...

    def publish(self, topic: str, kind: str, data: bytes, *, again: bool = False) -> None:
        """Gossip ``data`` on ``topic``; it comes back to this node's own subscription after
        the effects under way."""
        ...

    async def wait_connected(self) -> None:
        """Return once some peer is connected."""
        ...

    async def head_links(self, address: str, experiment_id: str, after: int) -> LinksAnswer: ...

    async def window_records(
        self, address: str, experiment_id: str, window: int
    ) -> WindowAnswer: ...

    async def record(self, address: str, record_id: str) -> bytes:
        """The envelope ``address`` keeps under ``record_id`` (unverified)."""
        ...

    async def push_blob(self, address: str, blob_id: str) -> int:
        """Upload a kept blob to ``address``; the bytes sent (0: it had it already)."""
        ...

    async def download(
        self,
        blob_id: str,
        providers: Sequence[str],
        *,
        size: int | None,
        on_bad: ProviderNote,
        on_fault: ProviderNote,
        on_bytes: Callable[[int], None] | None = None,
    ) -> Downloaded:
        """Fetch ``blob_id`` from ``providers`` into the node's blob keep, verified by its
        hash. Raises :class:`TransportError` when no provider delivered and
        :class:`ProtocolViolation` when none served the right bytes. ``on_bytes(n)`` is
        called as bytes arrive, so the bytes of a fetch that fails or is cancelled are
        counted too."""
        ...
