"""The running node: one protocol role wired to the network layer and the stores.

A :class:`Node` owns a :class:`~p2ptrain.net.node.NetNode` (server, gossip, discovery), a
blob fetcher, its data directory and one window state machine from :mod:`p2ptrain.protocol`:

* a **trainer** (:class:`TrainerMachine`) trains each window in a worker thread -- the event
  loop keeps answering the network -- encodes Δ with the experiment's codec, pushes the blob
  to a seed when it has no server of its own, and gossips the signed update;
* a **reducer** or **validator** (:class:`Participant`) fetches each update's blob, reduces,
  proposes and attests on the slot timers of the protocol;
* a **seed** or **viewer** (:class:`Follower`) follows the certified chain and keeps each
  head's weights, so late joiners and trainers can fetch them from it.

The machines never do I/O: they return actions and this module carries them out
(:meth:`Node._carry_out`). Everything that arrives from a peer is verified before a machine
sees it: envelopes by signature (gossip does it), certificates against the manifest, blobs by
hash (the fetcher does it) and chains link by link. Bad input is counted against the peer
that sent it (:meth:`NetNode.strike`) and the node carries on.

Persistence (:mod:`.persist`) happens before the action that depends on it; a node started
again on its data directory re-verifies its stored chain from genesis and resumes from the
last certified head it adopted, then catches up with its peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from p2ptrain.aggregate.codecs import make_encoder, max_update_bytes
from p2ptrain.core.certificate import CertifiedLink
from p2ptrain.core.encoding import encode
from p2ptrain.core.envelope import Signed, open_envelope
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.records import Attestation, Head, PeerRecord, Proposal, Update
from p2ptrain.core.tensors import schema_of
from p2ptrain.data.shards import lease_indices
from p2ptrain.errors import LocalError, ProtocolViolation, TransportError
from p2ptrain.net.config import NetConfig
from p2ptrain.net.content import Answer, text_answer
from p2ptrain.net.gossip import CERTIFICATE_KIND, Delivered
from p2ptrain.net.node import NetNode
from p2ptrain.net.transfer import BlobFetcher
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.setup import NodeSettings, Prepared
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.follower import Follower
from p2ptrain.protocol.participant import Participant
from p2ptrain.protocol.reduction import BaseState
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.store.atomic import write_atomically
from p2ptrain.torch.workload import Workload

__all__ = ["Node", "experiment_topic", "window_seed"]

logger = logging.getLogger(__name__)

STATUS_FILE = "status.json"
_EXPERIMENT_KINDS = ("update", "proposal", "attestation", CERTIFICATE_KIND)
#: Updates and proposals for a window we have not opened yet, kept until we have.
_MAX_EARLY = 4096
_FETCH_ATTEMPTS = 6
_MAX_PROVIDERS = 8
_RECENT_REPORTS = 20
#: After its last window a serving node stays up until no blob was fetched for this long
#: (peers fetch the last head's weights), and never longer than the maximum.
_LINGER_QUIET_S = 3.0
_LINGER_MAX_S = 30.0

Event = dict[str, Any]


def experiment_topic(experiment_id: str) -> str:
    return f"exp/{experiment_id}"


def window_seed(peer_id: str, window: int) -> int:
    """The seed of a trainer's minibatch order in a window (the demo's DDP baseline draws
    the same minibatches with it)."""
    digest = hashlib.sha256(f"p2ptrain/v1/batches\0{peer_id}\0{window}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


class Node:
    """One node. ``await node.run()`` until :meth:`stop` (or the ``windows`` target)."""

    def __init__(
        self,
        settings: NodeSettings,
        prepared: Prepared,
        store: NodeStore,
        *,
        workload: Workload | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        self.settings = settings
        self.identity = prepared.identity
        self.peer_id = prepared.identity.peer_id
        self.network = prepared.network
        self.manifest = prepared.experiment.record
        self.experiment_id = prepared.experiment.record_id
        self.topic = experiment_topic(self.experiment_id)
        self.store = store
        self.workload = workload
        self._on_event = on_event
        self._rng = random.Random()
        self._stop = asyncio.Event()
        self._target_reached = False
        self._wake = asyncio.Event()
        self._train_ready = asyncio.Event()
        self._pending_train: act.Train | None = None
        self._early_updates: dict[str, Signed[Update]] = {}
        self._early_proposals: dict[str, Signed[Proposal]] = {}
        self._fetching: set[str] = set()
        self._catching_up = asyncio.Lock()
        self._stored_height = 0
        self._reports: list[dict[str, str]] = []
        self._last_window: dict[str, Any] | None = None
        self._window_started = time.monotonic()
        self._trained: dict[str, Any] = {}
        self._net: NetNode | None = None
        self._fetcher: BlobFetcher | None = None
        genesis = prepared.genesis
        roles = set(settings.roles)
        key = self.identity.public_key
        self.machine: Follower
        if roles & {"validator", "reducer"}:
            validator = "validator" in roles
            if validator and key not in self.manifest.validators:
                raise LocalError(
                    f"this node's key {key.hex()} is not a validator of experiment "
                    f"{self.experiment_id[:16]}; add it to the experiment's validators (a new "
                    "revision) or run this node as a trainer"
                )
            if not validator and key not in self.manifest.reducers:
                raise LocalError(
                    f"this node's key {key.hex()} is not a reducer of experiment "
                    f"{self.experiment_id[:16]}; add it to the experiment's reducers"
                )
            participant = Participant(
                self.manifest,
                self.identity,
                genesis,
                validator=validator,
                reducers=self.manifest.reducers,
                now=time.monotonic(),
            )
            participant.votes.update(store.votes())
            self.machine = participant
        elif "trainer" in roles:
            if workload is None:
                raise LocalError("a trainer needs a workload (the model and data to train)")
            self.machine = TrainerMachine(self.manifest, self.identity, genesis)
            self._encoder = make_encoder(
                self.manifest.codec, schema_of(genesis), seed=window_seed(self.peer_id, 0)
            )
        else:
            self.machine = Follower(self.manifest, self.identity, genesis)
        self._max_update = max_update_bytes(self.manifest.codec, schema_of(genesis))

    # -- life cycle -----------------------------------------------------------------------

    @property
    def net(self) -> NetNode:
        if self._net is None:
            raise LocalError("the node is not running")
        return self._net

    @property
    def fetcher(self) -> BlobFetcher:
        assert self._fetcher is not None
        return self._fetcher

    def stop(self) -> None:
        """Ask :meth:`run` to return (safe from a signal handler on the loop)."""
        self._stop.set()

    async def run(self) -> Event:
        """Run until stopped; return the final status."""
        s = self.settings
        config = NetConfig(
            host=s.host,
            port=s.port,
            advertise=s.advertise,
            bootstrap=s.bootstrap,
            mdns=s.mdns,
        )
        torch.set_num_threads(max(1, s.threads))
        net = NetNode(
            identity=self.identity,
            network=self.network.record,
            blobs=self.store.blobs,
            config=config,
            roles=s.roles,
            secret=s.secret,
            relay=s.relay,
        )
        self._net = net
        self._fetcher = BlobFetcher(
            net.client,
            self.store.blobs,
            timeout_s=s.fetch_timeout_s,
            on_bad_provider=self._bad_provider,
        )
        handlers = net.content.handlers
        handlers["/v1/records/"] = self._answer_record
        handlers["/v1/status"] = self._answer_status
        handlers["/v1/network"] = self._answer_network
        async with net:
            net.serve_chain(self.machine.chain)
            net.gossip.subscribe(self.topic, self._on_message, self._check_message)
            self._restore()
            self._emit(
                "ready",
                address=net.address,
                experiment_id=self.experiment_id,
                height=self.machine.chain.height,
            )
            if isinstance(self.machine, Participant):
                net.spawn(self._tick_forever(), "ticker")
            if isinstance(self.machine, TrainerMachine):
                net.spawn(self._train_forever(), "trainer")
            net.spawn(self._sync_forever(), "sync")
            net.spawn(self._status_forever(), "status")
            self._check_target()
            await self._stop.wait()
            if self._target_reached:
                await self._linger()
            status = self.status()
            self._write_status(status)
        self._emit("stopped", height=self.machine.chain.height)
        return status

    def _restore(self) -> None:
        """Resume from the stored chain (verified again from genesis), or start fresh."""
        now = time.monotonic()
        links = self.store.links(self.experiment_id)
        if links:
            tip = links[-1][0]
            try:
                weights = bytes(self.store.blobs.get(tip.weights_blob))
                optimizer = (
                    None
                    if tip.optimizer_blob is None
                    else bytes(self.store.blobs.get(tip.optimizer_blob))
                )
            except (OSError, ProtocolViolation) as exc:
                raise LocalError(
                    f"the weights of stored head {tip.height} are missing or damaged ({exc}); "
                    "move the data directory away and join again"
                ) from exc
            actions = self.machine.receive_chain(
                now, links, weights, optimizer, self.identity.public_key
            )
            if self.machine.chain.height != tip.height:
                raise LocalError(
                    f"the stored chain in {self.settings.data_dir} does not verify "
                    f"({actions}); move the data directory away and join again"
                )
            self._stored_height = tip.height
            logger.info("resumed at height %d (head %s)", tip.height, tip.id[:12])
            self._carry_out(actions)
        elif isinstance(self.machine, TrainerMachine):
            self._carry_out(self.machine.start(now))
        if isinstance(self.machine, TrainerMachine):
            self._load_trainer_state()

    # -- gossip in ------------------------------------------------------------------------

    def _check_message(self, message: Delivered) -> str | None:
        """The topic validator: None to accept and forward, else why not (a strike)."""
        if message.kind not in _EXPERIMENT_KINDS:
            return f"{message.kind!r} does not travel on an experiment topic"
        record = message.record
        if isinstance(record, CertifiedLink):
            verdict = record.check(self.manifest, self.experiment_id)
            return None if verdict else f"bad certificate: {verdict.reason}"
        inner = record.record
        if getattr(inner, "experiment_id", None) != self.experiment_id:
            return "record for another experiment"
        if isinstance(inner, Update):
            if inner.delta_bytes > self._max_update or inner.codec != self.manifest.codec.name:
                return "update blob too large or in the wrong codec"
        elif isinstance(inner, Attestation) and inner.validator not in self.manifest.validators:
            return "attestation from a key that is not a validator"
        return None

    def _on_message(self, message: Delivered) -> None:
        now = time.monotonic()
        record = message.record
        if isinstance(record, CertifiedLink):
            sender = self._key_of(message.from_peer)
            self._carry_out(
                self.machine.receive_certificate(now, record.head, record.certificate, sender)
            )
            return
        inner = record.record
        if isinstance(inner, Update):
            self._on_update(record, inner)
        elif isinstance(inner, Proposal):
            self._remember(record, "proposal", inner.window)
            self._on_proposal(record, inner)
        elif isinstance(inner, Attestation) and isinstance(self.machine, Participant):
            self._carry_out(self.machine.receive_attestation(now, record))

    def _remember(self, signed: Signed[Any], kind: str, height: int) -> None:
        if isinstance(self.machine, TrainerMachine):
            return  # trainers relay, but nobody asks them for records
        self.store.put_signed(
            signed.record_id,
            kind,
            bytes(signed.envelope.encode()),
            self.experiment_id,
            height,
        )

    def _on_update(self, signed: Signed[Update], update: Update) -> None:
        machine = self.machine
        if not isinstance(machine, Participant) and "seed" not in self.settings.roles:
            return
        self._remember(signed, "update", update.window)
        if not isinstance(machine, Participant):
            return
        if update.window > machine.window:
            if len(self._early_updates) < _MAX_EARLY:
                self._early_updates[signed.record_id] = signed
            return
        if update.window < machine.window or update.base_head != machine.base.head_id:
            return
        self.net.spawn(self._fetch_update(signed), f"update-{signed.record_id[:8]}")

    def _on_proposal(self, signed: Signed[Proposal], proposal: Proposal) -> None:
        machine = self.machine
        if not isinstance(machine, Participant):
            return
        if proposal.window > machine.window:
            if len(self._early_proposals) < _MAX_EARLY:
                self._early_proposals[signed.record_id] = signed
            return
        self._carry_out(machine.receive_proposal(time.monotonic(), signed))

    def _key_of(self, peer_id: str) -> bytes:
        signed = self.net.peers.get(peer_id) if peer_id else None
        return self.identity.public_key if signed is None else signed.record.public_key

    # -- fetching -------------------------------------------------------------------------

    def _providers(self, first: Sequence[str] = ()) -> list[str]:
        """Addresses to fetch blobs and records from: the peers named first, then seeds,
        then every reachable peer we know (each verified by hash, none trusted)."""
        net = self.net
        addresses = [a for p in first if (a := net.address_of(p)) is not None]
        addresses += self.settings.bootstrap
        others = [a for s in net.peers if (a := net.address_of(s.record.peer_id)) is not None]
        self._rng.shuffle(others)
        addresses += others
        own = net.address
        unique = [a for a in dict.fromkeys(addresses) if a != own]
        return unique[:_MAX_PROVIDERS]

    async def _fetch_blob(
        self, blob_id: str, first: Sequence[str] = (), size: int | None = None
    ) -> bytes:
        if not self.store.blobs.has(blob_id):
            providers = self._providers(first)
            if not providers:
                raise TransportError(f"nobody to fetch blob {blob_id[:12]} from yet")
            await self.fetcher.fetch(blob_id, providers, size=size)
        return bytes(self.store.blobs.get(blob_id))

    async def _fetch_update(self, signed: Signed[Update]) -> None:
        update = signed.record
        for attempt in range(_FETCH_ATTEMPTS):
            machine = self.machine
            assert isinstance(machine, Participant)
            if machine.window != update.window:
                return
            try:
                blob = await self._fetch_blob(
                    update.delta_blob, [update.trainer_id], size=update.delta_bytes
                )
            except TransportError as exc:
                logger.info("update %s: %s (attempt %d)", signed.record_id[:12], exc, attempt + 1)
                await asyncio.sleep(0.5 * 2**attempt)
                continue
            except ProtocolViolation as exc:
                # nobody served bytes with the update's hash; a provider proven wrong was
                # reported by the fetcher, and the trainer may be honest (its blob lost)
                logger.warning("update %s: no good blob: %s", signed.record_id[:12], exc)
                return
            self._carry_out(machine.receive_update(time.monotonic(), signed, blob))
            return

    async def _fetch_updates(self, action: act.FetchUpdates) -> None:
        """Updates a proposal names that we lack: records by id, then their blobs."""
        proposer = peer_id_of(action.peer)
        for update_id in action.update_ids:
            signed = await self._fetch_update_record(update_id, proposer)
            if signed is None:
                logger.warning("nobody served update %s named by a proposal", update_id[:12])
                continue
            self._remember(signed, "update", signed.record.window)
            await self._fetch_update(signed)

    async def _fetch_update_record(self, update_id: str, proposer: str) -> Signed[Update] | None:
        """The signed update ``update_id``, from our store or a peer (the proposer first);
        a peer that serves anything else is reported."""
        raw = self.store.record(update_id)
        if raw is not None:
            return open_envelope(raw, Update)
        for address in self._providers([proposer]):
            try:
                raw = await self.net.client.record(address, update_id)
                signed = open_envelope(raw, Update)
                if signed.record_id != update_id:
                    raise ProtocolViolation(f"asked for update {update_id[:12]}, got another")
                return signed
            except TransportError as exc:
                logger.info("record %s from %s: %s", update_id[:12], address, exc)
            except ProtocolViolation as exc:
                self._blame(address, f"served a bad update record: {exc}")
        return None

    async def _fetch_state(self, action: act.FetchState) -> None:
        head, head_id = action.head, action.head_id
        if head_id in self._fetching:
            return
        self._fetching.add(head_id)
        first = [] if action.peer is None else [peer_id_of(action.peer)]
        try:
            for attempt in range(_FETCH_ATTEMPTS * 2):
                machine = self.machine
                if machine.chain.tip.head_id != head_id or machine.base.head_id == head_id:
                    return
                try:
                    weights, optimizer = await self._fetch_head_blobs(head, first)
                except (TransportError, ProtocolViolation) as exc:
                    logger.info("weights of head %s: %s", head_id[:12], exc)
                    await asyncio.sleep(min(5.0, 0.25 * 2**attempt))
                    continue
                self._carry_out(
                    machine.receive_state(time.monotonic(), head_id, weights, optimizer)
                )
                return
        finally:
            self._fetching.discard(head_id)

    async def _fetch_head_blobs(
        self, head: Head, first: Sequence[str]
    ) -> tuple[bytes, bytes | None]:
        weights = await self._fetch_blob(head.weights_blob, first)
        optimizer = None
        if head.optimizer_blob is not None:
            optimizer = await self._fetch_blob(head.optimizer_blob, first)
        return weights, optimizer

    async def _catch_up(self, address: str | None = None) -> None:
        """Ask a peer for certified heads above ours; verify and adopt them."""
        if self._catching_up.locked():
            return
        async with self._catching_up:
            providers = [address] if address else self._providers()
            for provider in providers:
                height = self.machine.chain.height
                try:
                    links = await self.net.client.head_links(provider, self.experiment_id, height)
                except (TransportError, ProtocolViolation) as exc:
                    logger.debug("catch-up from %s: %s", provider, exc)
                    continue
                links = [(h, c) for h, c in links if h.height > height]
                if not links:
                    continue
                try:
                    weights, optimizer = await self._fetch_head_blobs(links[-1][0], [])
                except (TransportError, ProtocolViolation) as exc:
                    logger.info("catch-up weights: %s", exc)
                    continue
                sender = self._key_at(provider)
                self._carry_out(
                    self.machine.receive_chain(time.monotonic(), links, weights, optimizer, sender)
                )
                return

    def _record_at(self, address: str) -> PeerRecord | None:
        """The signed record of the peer that advertises ``address``, if we know it."""
        for signed in self.net.peers:
            if address in signed.record.addresses:
                return signed.record
        return None

    def _key_at(self, address: str) -> bytes:
        record = self._record_at(address)
        return self.identity.public_key if record is None else record.public_key

    # -- carrying out the machine's actions -----------------------------------------------

    def _carry_out(self, actions: Sequence[act.Action]) -> None:
        for action in actions:
            try:
                self._do(action)
            except (TransportError, ProtocolViolation, OSError) as exc:
                logger.warning("%s failed: %s", type(action).__name__, exc)
        self._wake.set()

    def _do(self, action: act.Action) -> None:
        net = self.net
        if isinstance(action, act.SendUpdate):
            net.spawn(self._publish_update(action), "publish-update")
        elif isinstance(action, act.SendProposal):
            proposal = action.proposal
            self._keep_reduction(proposal.record.head.id)
            self._remember(proposal, "proposal", proposal.record.window)
            net.publish(self.topic, "proposal", bytes(proposal.envelope.encode()))
        elif isinstance(action, act.SendAttestation):
            attestation = action.attestation.record
            if attestation.validator == self.identity.public_key:
                self.store.put_vote(attestation.height, attestation.head_id)
                self._keep_reduction(attestation.head_id)
            net.publish(self.topic, "attestation", bytes(action.attestation.envelope.encode()))
        elif isinstance(action, act.SendCertificate):
            link = CertifiedLink(head=action.head, certificate=action.certificate)
            net.publish(self.topic, CERTIFICATE_KIND, encode(link))
        elif isinstance(action, act.FetchUpdates):
            net.spawn(self._fetch_updates(action), "fetch-updates")
        elif isinstance(action, act.FetchState):
            net.spawn(self._fetch_state(action), "fetch-state")
        elif isinstance(action, act.FetchChain):
            address = net.address_of(peer_id_of(action.peer))
            net.spawn(self._catch_up(address), "catch-up")
        elif isinstance(action, act.Adopted):
            self._adopted(action)
        elif isinstance(action, act.Reported):
            self._report(action.peer_id, action.reason)
        elif isinstance(action, act.Train):
            self._pending_train = action
            self._train_ready.set()

    def _keep_reduction(self, head_id: str) -> None:
        """Store the blobs of a head we computed, so peers can fetch them once certified."""
        machine = self.machine
        if not isinstance(machine, Participant):
            return
        reduction = machine.reduction_of(head_id)
        if reduction is None:
            return
        for blob in (reduction.weights_blob, reduction.optimizer_blob):
            if blob is not None:
                self.store.blobs.put(blob)

    def _adopted(self, action: act.Adopted) -> None:
        machine = self.machine
        state = machine.state_of(action.head_id)
        if state is not None:
            for blob in state:
                if blob is not None:
                    self.store.blobs.put(blob)
        for height in range(self._stored_height + 1, machine.chain.height + 1):
            link = machine.chain.at(height)
            if link is not None and link.certificate is not None:
                self.store.put_link(link.head, link.certificate)
        self._stored_height = machine.chain.height
        head = action.head
        now = time.monotonic()
        self._last_window = {
            "height": head.height,
            "head_id": action.head_id,
            "accepted": len(head.accepted),
            "quarantined": len(head.quarantine),
            "reason": action.reason,
            "seconds": round(now - self._window_started, 2),
        }
        self._window_started = now
        self._emit("adopted", **self._last_window)
        if isinstance(machine, Participant):
            self._replay_early()
        self._write_status(self.status())
        self._check_target()

    def _replay_early(self) -> None:
        machine = self.machine
        assert isinstance(machine, Participant)
        window = machine.window
        updates, self._early_updates = self._early_updates, {}
        for signed in updates.values():
            if signed.record.window == window:
                self._on_update(signed, signed.record)
            elif signed.record.window > window:
                self._early_updates[signed.record_id] = signed
        proposals, self._early_proposals = self._early_proposals, {}
        for proposal in proposals.values():
            if proposal.record.window >= window:
                self._on_proposal(proposal, proposal.record)

    def _check_target(self) -> None:
        target = self.settings.windows
        if target is not None and self.machine.base.head.height >= target:
            self._target_reached = True
            self._stop.set()

    async def _linger(self) -> None:
        """The last window is done: peers may still need its head's weights from us, so a
        node that serves keeps serving until nobody has fetched a blob for a while."""
        server = self.net.statistics().server
        if server is None:
            return
        started = last_change = time.monotonic()
        served = server.blobs_served
        while time.monotonic() - last_change < _LINGER_QUIET_S:
            if time.monotonic() - started > _LINGER_MAX_S:
                return
            await asyncio.sleep(0.25)
            now_served = self.net.statistics().server
            if now_served is not None and now_served.blobs_served != served:
                served, last_change = now_served.blobs_served, time.monotonic()

    def _report(self, peer_id: str, reason: str) -> None:
        logger.warning("peer %s: %s", peer_id[:16], reason)
        self._reports = [*self._reports, {"peer": peer_id, "reason": reason}][-_RECENT_REPORTS:]
        if len(peer_id) == 64 and peer_id != self.peer_id:
            self.net.strike(peer_id, reason)
        self._emit("reported", peer=peer_id, reason=reason)

    def _bad_provider(self, address: str, reason: str) -> None:
        self._blame(address, f"served a bad blob: {reason}")

    def _blame(self, address: str, reason: str) -> None:
        """Report the peer at ``address`` (by its signed record), or log the address."""
        record = self._record_at(address)
        if record is None:
            logger.warning("%s %s", address, reason)
        else:
            self._report(record.peer_id, reason)

    # -- the trainer ----------------------------------------------------------------------

    async def _publish_update(self, action: act.SendUpdate) -> None:
        blobs = self.store.blobs
        blob_id = blobs.put(action.blob)
        if self.net.address is None:
            await self._push(blob_id)
        envelope = bytes(action.update.envelope.encode())
        self.net.publish(self.topic, "update", envelope)
        update = action.update.record
        self._emit(
            "published",
            window=update.window,
            update_id=action.update.record_id,
            bytes=len(action.blob),
        )

    async def _push(self, blob_id: str) -> None:
        """An outbound-only trainer hands its blob to a reachable peer (a seed first)."""
        path = self.store.blobs.path(blob_id)
        errors = []
        for attempt in range(_FETCH_ATTEMPTS):
            for address in self._providers():
                try:
                    await self.net.client.push_blob(address, blob_id, path)
                    return
                except (TransportError, ProtocolViolation) as exc:
                    errors.append(f"{address}: {exc}")
            await asyncio.sleep(0.5 * 2**attempt)
        raise TransportError(f"no peer took update blob {blob_id[:12]}: {'; '.join(errors[-3:])}")

    async def _train_forever(self) -> None:
        machine = self.machine
        assert isinstance(machine, TrainerMachine)
        while True:
            await self._train_ready.wait()
            self._train_ready.clear()
            action, self._pending_train = self._pending_train, None
            if action is None or action.base_head != machine.base.head_id:
                continue
            base = machine.base
            started = time.monotonic()
            blob, before, after = await asyncio.to_thread(self._train_window, action, base)
            self._trained = {
                "window": action.window,
                "loss_before": before,
                "loss_after": after,
                "seconds": round(time.monotonic() - started, 2),
                "blob_bytes": len(blob),
            }
            self._emit("trained", **self._trained)
            self._carry_out(machine.finish(action.window, action.base_head, blob, before, after))

    def _train_window(self, action: act.Train, base: BaseState) -> tuple[bytes, float, float]:
        """In a worker thread: the inner steps, the pseudo-gradient, its encoding."""
        machine = self.machine
        workload = self.workload
        assert isinstance(machine, TrainerMachine) and workload is not None
        lease = machine.lease(action.window)
        indices = lease_indices(self.manifest.dataset, lease)
        result = workload.train_window(
            base.weights,
            indices,
            steps=self.manifest.inner_steps,
            seed=window_seed(self.peer_id, action.window),
        )
        delta = {name: base.weights[name] - result.weights[name] for name in base.weights}
        blob = self._encoder.encode(delta)
        self.store.save_trainer_state(
            workload.optimizer_state(),
            {"window": str(action.window), "experiment": self.experiment_id},
        )
        return blob, result.loss_before, result.loss_after

    def _load_trainer_state(self) -> None:
        loaded = self.store.load_trainer_state()
        if loaded is None or self.workload is None:
            return
        tensors, metadata = loaded
        if metadata.get("experiment") != self.experiment_id:
            logger.warning("ignoring a trainer state saved for another experiment")
            return
        self.workload.load_optimizer_state(tensors)
        logger.info("inner optimizer state restored (window %s)", metadata.get("window"))

    # -- timers ---------------------------------------------------------------------------

    async def _tick_forever(self) -> None:
        machine = self.machine
        assert isinstance(machine, Participant)
        while True:
            now = time.monotonic()
            delay = max(0.0, machine.next_wakeup(now) - now)
            self._wake.clear()
            # not asyncio.wait_for: on 3.11 it can swallow a cancellation that arrives as
            # the event is set, and the node would never stop
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._carry_out(machine.tick(time.monotonic()))

    async def _sync_forever(self) -> None:
        """Missed a certificate (or restarted)? Ask a peer now and then whether the chain
        moved past us; answers are verified link by link."""
        while True:
            providers = self._providers()
            if providers:
                with contextlib.suppress(TransportError):
                    await self._catch_up(self._rng.choice(providers))
            await asyncio.sleep(self.settings.sync_interval_s * (0.75 + self._rng.random() / 2))

    async def _status_forever(self) -> None:
        while True:
            await asyncio.sleep(2.0)
            self._write_status(self.status())

    # -- status ---------------------------------------------------------------------------

    def status(self) -> Event:
        machine = self.machine
        net = self._net
        tip = machine.chain.tip
        statistics: dict[str, Any] = {}
        stats = getattr(machine, "statistics", None)
        if callable(stats):
            statistics = asdict(stats())
        bytes_sent = 0
        peers = banned = 0
        connections = {"outbound": 0, "inbound": 0}
        if net is not None:
            n = net.statistics()
            bytes_sent = net.client.bytes_pushed + n.gossip.bytes_sent
            peers = n.peers.peers
            banned = n.peers.banned
            connections = {"outbound": n.outbound, "inbound": n.inbound}
        return {
            "peer_id": self.peer_id,
            "roles": list(self.settings.roles),
            "address": None if net is None else net.address,
            "experiment_id": self.experiment_id,
            "height": machine.chain.height,
            "head_id": tip.head_id,
            "adopted_head_id": machine.base.head_id,
            "peers": peers,
            "banned": banned,
            "connections": connections,
            "last_window": self._last_window,
            # what the open window is doing or why it has no head yet (reducers, validators)
            "open_window": {
                "window": tip.head.height + 1,
                "reason": getattr(machine, "last_reason", None),
            },
            "reasons": [r["reason"] for r in self._reports[-5:]],
            "reports": list(self._reports),
            "machine": statistics,
            "trainer": self._trained or None,
            "bytes_sent": bytes_sent,
            "pid": os.getpid(),
        }

    def _write_status(self, status: Event) -> None:
        try:
            data = json.dumps(status, indent=1, default=str).encode()
            write_atomically(self.settings.data_dir / STATUS_FILE, data)
        except LocalError as exc:
            logger.warning("%s", exc)

    def _answer_status(self, target: str) -> Answer:
        body = json.dumps(self.status(), default=str).encode()
        return Answer(200, {"Content-Type": "application/json"}, body)

    def _answer_record(self, target: str) -> Answer:
        record_id = target.split("?", maxsplit=1)[0].rsplit("/", 1)[-1]
        raw = self.store.record(record_id) if len(record_id) == 64 else None
        if raw is None:
            return text_answer(404, f"this node does not hold record {record_id[:64]}")
        return Answer(200, {"Content-Type": "application/msgpack"}, raw)

    def _answer_network(self, target: str) -> Answer:
        body = bytes(self.network.envelope.encode())
        return Answer(200, {"Content-Type": "application/msgpack"}, body)

    def _emit(self, event: str, **fields: Any) -> None:
        if self._on_event is not None:
            self._on_event({"event": event, "peer_id": self.peer_id, **fields})
