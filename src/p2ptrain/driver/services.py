"""The peer services every role runner of a node shares: one network, one store.

Below the runners (they import this module, never each other), above the network layer:

* **providers** -- whom to ask for a blob or a record: the peers named first, then the
  seeds, then every reachable peer we know, each verified by hash, none trusted;
* **fetch with blame** -- blobs through the transport's verifying download (a provider that
  serves bytes with another hash is reported by its signed peer record), update records by
  id, hedged across providers, a head's weights (a catch-up page and a window's records:
  :mod:`.catch_up`); an outbound-only trainer's update blob pushed to a reachable peer;
* **key lookup** -- the public key behind a peer id or an address;
* **reporting** -- a peer proven to misbehave is logged, struck and shown in the status;
* **publishing** -- a record goes out on the experiment's topic (gossip hands it to this
  node's own subscription too, after the effects under way: every other role sees it);
* **records** -- the signed updates and proposals a node that serves keeps for its peers.

All of it goes through the node's :class:`~.transport.Transport` and :class:`~.transport.Keep`
(a real network and data directory, or the simulator's), on the loop's clock (:mod:`.clock`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from p2ptrain.core.certificate import CertifiedLink
from p2ptrain.core.encoding import encode
from p2ptrain.core.envelope import Signed, open_envelope
from p2ptrain.core.identity import Identity
from p2ptrain.core.records import Head, Update
from p2ptrain.driver.clock import now as clock
from p2ptrain.driver.racing import hedged
from p2ptrain.driver.storage import StorageHealth
from p2ptrain.driver.transport import Downloaded, Keep, Message, Peer, Transport
from p2ptrain.errors import BlobNotFound, ProtocolViolation, TransportError
from p2ptrain.observe.events import NodeEvent, PeerReported
from p2ptrain.observe.status import PeerReport
from p2ptrain.observe.telemetry import NodeTelemetry
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.intake import Admission
from p2ptrain.protocol.policy import FETCH_ATTEMPTS
from p2ptrain.protocol.reduction import ByteSource
from p2ptrain.protocol.role import RoleMachine

__all__ = ["PeerServices", "experiment_topic"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_MAX_PROVIDERS = 8
#: A provider that failed in transit within this long is asked after the others.
_FAULT_MEMORY_S = 60.0
_RECENT_REPORTS = 20
#: Our own messages whose publishing role is remembered until they come back to us.
_ORIGINS_KEPT = 256
#: The same report from several roles (each judged the same record) counts once.
_SAME_REPORT_S = 5.0


def experiment_topic(experiment_id: str) -> str:
    return f"exp/{experiment_id}"


class PeerServices:
    """What the runners of one node share: its network (``net``) and its store
    (``store``), each behind the driver's seam (:mod:`.transport`).

    ``admit`` judges the records that did not come by gossip (a window sync's) by the node's
    intake rules; ``on_adopted`` is told when a role's machine adopted a head; ``on_update``
    of each update record a role keeps (its blob is that window's); ``telemetry`` counts and
    times what happens (a spare one if not given)."""

    def __init__(
        self,
        *,
        net: Transport,
        identity: Identity,
        store: Keep,
        storage: StorageHealth,
        experiment_id: str,
        bootstrap: Sequence[str],
        keeps_records: bool,
        emit: Callable[[NodeEvent], None],
        admit: Callable[[Signed[Any]], Admission],
        on_adopted: Callable[[RoleMachine, act.Adopted], None],
        on_update: Callable[[Update], None] | None = None,
        telemetry: NodeTelemetry | None = None,
        seed: int | None = None,
    ) -> None:
        """``seed``: the provider order's shuffles (None: from the operating system)."""
        self.identity = identity
        self.peer_id = identity.peer_id
        self.store = store
        self.experiment_id = experiment_id
        self.topic = experiment_topic(experiment_id)
        self.bootstrap = tuple(bootstrap)
        #: Trainers and viewers relay records, but nobody asks them for any.
        self.keeps_records = keeps_records
        self.emit = emit
        self.reports: deque[PeerReport] = deque(maxlen=_RECENT_REPORTS)
        self.rng = random.Random(seed)
        self.on_adopted = on_adopted
        self.admit = admit
        self.on_update: Callable[[Update], None] = on_update or (lambda _: None)
        self.telemetry = telemetry or NodeTelemetry()
        self.net = net
        #: Whether local writes go through (a full disk is reported once, not per write).
        self.storage = storage
        #: One catch-up page asked at a time (:func:`~.catch_up.fetch_chain`).
        self.catching_up = asyncio.Lock()
        self._recent: dict[tuple[str, str], float] = {}
        #: The role that published each of our recent messages, until it comes back to us.
        self._origins: OrderedDict[bytes, str] = OrderedDict()
        #: address -> (transport faults in a row, when the last was): asked last a while
        self._faults: dict[str, tuple[int, float]] = {}

    # -- publishing and records -----------------------------------------------------------

    def publish(
        self,
        kind: str,
        record: Signed[Any] | CertifiedLink,
        *,
        again: bool = False,
        origin: str | None = None,
    ) -> None:
        """Send ``record`` to the peers and to every role of this node but ``origin`` (the
        role that made it, which holds it already: a validator counts its own vote once;
        ``again``: it was sent before, and goes to every neighbour once more)."""
        data = bytes(
            encode(record) if isinstance(record, CertifiedLink) else record.envelope.encode()
        )
        if origin is not None:
            self._origins[hashlib.sha256(data).digest()] = origin
            while len(self._origins) > _ORIGINS_KEPT:
                self._origins.popitem(last=False)
        self.net.publish(self.topic, kind, data, again=again)

    def published_by(self, message: Message) -> str | None:
        """The role of this node that published ``message`` (None: a peer's, or no role's)."""
        if message.from_peer:
            return None
        return self._origins.pop(hashlib.sha256(message.data).digest(), None)

    def remember(self, signed: Signed[Any], kind: str, height: int) -> None:
        """Keep a signed record peers may ask for by id (nodes that serve)."""
        if isinstance(signed.record, Update):
            self.on_update(signed.record)
        if not self.keeps_records:
            return
        self.store.put_signed(
            signed.record_id, kind, bytes(signed.envelope.encode()), self.experiment_id, height
        )

    # -- whom to ask ----------------------------------------------------------------------

    def providers(self, first: Sequence[str] = ()) -> list[str]:
        """Addresses to fetch blobs and records from: the peers named first, then seeds,
        then every reachable peer we know (each verified by hash, none trusted)."""
        net = self.net
        addresses = [a for p in first if (a := net.address_of(p)) is not None]
        addresses += self.bootstrap
        others = [a for r in net.known_peers() if (a := net.address_of(r.peer_id)) is not None]
        self.rng.shuffle(others)
        addresses += others
        own = net.address
        unique = [a for a in dict.fromkeys(addresses) if a != own]
        # those that failed in transit lately go last (a stable sort keeps the order
        # otherwise): tried when the others cannot help, never left out
        now = clock()
        unique.sort(key=lambda a: self._fault_count(a, now))
        return unique[:_MAX_PROVIDERS]

    def transport_fault(self, address: str, reason: str) -> None:
        """``address`` failed in transit (no answer, too slow, cut off): not misbehaviour,
        but it is asked after the others for a while."""
        count, _ = self._faults.get(address, (0, 0.0))
        if len(self._faults) > 10_000:
            self._faults.clear()
        self._faults[address] = (count + 1, clock())
        logger.debug("provider %s: %s", address, reason)

    def _fault_count(self, address: str, now: float) -> int:
        count, when = self._faults.get(address, (0, 0.0))
        return count if now - when < _FAULT_MEMORY_S else 0

    def key_of(self, peer_id: str) -> bytes:
        """The public key of ``peer_id`` ("", or a peer we do not know: our own)."""
        record = self.net.peer_record(peer_id) if peer_id else None
        return self.identity.public_key if record is None else record.public_key

    def record_at(self, address: str) -> Peer | None:
        """The signed record of the peer that advertises ``address``, if we know it."""
        for record in self.net.known_peers():
            if address in record.addresses:
                return record
        return None

    def key_at(self, address: str) -> bytes:
        record = self.record_at(address)
        return self.identity.public_key if record is None else record.public_key

    # -- fetching -------------------------------------------------------------------------

    async def download(
        self,
        blob_id: str,
        first: Sequence[str] = (),
        size: int | None = None,
        *,
        kind: str = "other",
    ) -> Downloaded | None:
        """Fetch a blob into the store (verified by its hash) unless it is there already;
        the fetch's figures, or None when nothing had to be fetched. ``kind`` (update,
        aggregate, state, shard) files its bytes in the node's telemetry."""
        if self.store.blobs.has(blob_id):
            return None
        providers = self.providers(first)
        if not providers:
            raise TransportError(f"nobody to fetch blob {blob_id[:12]} from yet")
        telemetry = self.telemetry
        telemetry.blob_kind(blob_id, kind)

        def landed(n: int) -> None:  # counted as it lands: a fetch cut short moved bytes too
            telemetry.count_bytes("received", kind, n)

        result = await self.net.download(
            blob_id,
            providers,
            size=size,
            on_bad=self._bad,
            on_fault=self.transport_fault,
            on_bytes=landed,
        )
        self.storage.succeeded()
        telemetry.fetched(blob_id, kind, result.seconds)
        return result

    async def fetch_blob(
        self,
        blob_id: str,
        first: Sequence[str] = (),
        size: int | None = None,
        *,
        kind: str = "other",
    ) -> bytes | bytearray:
        # the store's fresh buffer: no second copy
        return await self._landed(blob_id, first, size, kind, self.store.blobs.get)

    async def fetch_update_blob(
        self, blob_id: str, first: Sequence[str] = (), size: int | None = None
    ) -> ByteSource:
        """An update blob, fetched into the store unless it is there, to be read by range:
        a reduction holds one window of each update, never its whole blob."""
        return await self._landed(blob_id, first, size, "update", self.store.blobs.reader)

    async def _landed(
        self,
        blob_id: str,
        first: Sequence[str],
        size: int | None,
        kind: str,
        read: Callable[[str], R],
    ) -> R:
        """``read(blob_id)`` once the blob is in the store. The node's collector may delete
        it between its landing and this task's turn to read it (its window passed while the
        fetch ran, on a node whose other role is ahead): then it is fetched once more, and
        a second loss is a fetch that failed (TransportError), not the role's failure."""
        for _ in range(2):
            await self.download(blob_id, first, size, kind=kind)
            try:
                return read(blob_id)
            except BlobNotFound:
                logger.info("%s blob %s was collected as it landed", kind, blob_id[:12])
        raise TransportError(
            f"{kind} blob {blob_id[:12]} was collected twice as soon as it landed (its window "
            "has passed here); the fetch is given up"
        )

    async def fetch_head_blobs(
        self, head: Head, first: Sequence[str] = ()
    ) -> tuple[bytes | bytearray, bytes | bytearray | None]:
        weights = await self.fetch_blob(head.weights_blob, first, kind="state")
        optimizer = None
        if head.optimizer_blob is not None:
            optimizer = await self.fetch_blob(head.optimizer_blob, first, kind="state")
        return weights, optimizer

    async def fetch_update_record(self, update_id: str, proposer: str) -> Signed[Update] | None:
        """The signed update ``update_id``, from our store or a peer (the proposer first);
        a peer that serves anything else is reported."""
        raw = self.store.record(update_id)
        if raw is not None:
            try:
                return open_envelope(raw, Update)
            except ProtocolViolation:  # the id of another kind of record: named wrongly
                logger.warning("record %s is not an update", update_id[:12])
                return None

        async def ask(address: str) -> Signed[Update] | None:
            try:
                raw = await self.net.record(address, update_id)
                signed = open_envelope(raw, Update)
                if signed.record_id != update_id:
                    raise ProtocolViolation(f"asked for update {update_id[:12]}, got another")
                return signed
            except TransportError as exc:
                self.transport_fault(address, str(exc))
                logger.info("record %s from %s: %s", update_id[:12], address, exc)
            except ProtocolViolation as exc:
                self.blame(address, f"served a bad update record: {exc}")
            return None

        return await self.first_answer(self.providers([proposer]), ask)

    async def first_answer(
        self, addresses: Sequence[str], ask: Callable[[str], Awaitable[T | None]]
    ) -> T | None:
        """``ask`` the providers hedged (:func:`~.racing.hedged`); one that does not answer
        in time is asked after the others for a while."""
        return await hedged(addresses, ask, on_timeout=self.transport_fault)

    async def push_blob(self, blob_id: str, dropped: Callable[[], str | None], window: int) -> bool:
        """An outbound-only trainer hands its update blob to a reachable peer (a seed
        first), trying again while the window is open. False when the push was dropped
        (``dropped()`` says why: the window was certified meanwhile, or the blob is gone;
        neither is the role's failure)."""
        errors = []
        for attempt in range(FETCH_ATTEMPTS):
            for address in self.providers():
                if (reason := dropped()) is not None:
                    logger.info("window %d: update blob %s not pushed: %s", window,
                                blob_id[:12], reason)  # fmt: skip
                    return False
                try:
                    if sent := await self.net.push_blob(address, blob_id):
                        self.telemetry.count_bytes("sent", "update", sent)
                    return True
                except FileNotFoundError:
                    continue  # collected as we opened it: said above, on the next turn
                except (TransportError, ProtocolViolation) as exc:
                    errors.append(f"{address}: {exc}")
            await asyncio.sleep(0.5 * 2**attempt)
        raise TransportError(f"no peer took update blob {blob_id[:12]}: {'; '.join(errors[-3:])}")

    # -- reporting ------------------------------------------------------------------------

    def report(self, peer_id: str, reason: str) -> None:
        """Count ``reason`` against the peer, once even when several roles found it."""
        now = clock()
        self._recent = {k: t for k, t in self._recent.items() if now - t < _SAME_REPORT_S}
        if (peer_id, reason) in self._recent:
            return
        self._recent[peer_id, reason] = now
        logger.warning("peer %s: %s", peer_id[:16], reason)
        self.reports.append(PeerReport(peer=peer_id, reason=reason))
        if len(peer_id) == 64 and peer_id != self.peer_id:
            self.net.strike(peer_id, reason)
        self.emit(PeerReported(peer_id=self.peer_id, peer=peer_id, reason=reason))

    def blame(self, address: str, reason: str) -> None:
        """Report the peer at ``address`` (by its signed record), or log the address."""
        record = self.record_at(address)
        if record is None:
            logger.warning("%s %s", address, reason)
        else:
            self.report(record.peer_id, reason)

    def _bad(self, address: str, reason: str) -> None:
        self.blame(address, f"served a bad blob: {reason}")
