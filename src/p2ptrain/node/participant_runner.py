"""The reducer and validator roles: collect a window's updates, propose, judge, attest.

The runner fetches each on-time update's blob (from its trainer first, then any provider),
hands proposals and attestations to the :class:`Participant`, ticks it on the protocol's
slot timers, and keeps the blobs of every head it computed so peers can fetch them once the
head is certified. Updates and proposals for the window after its open one wait in an
:class:`~p2ptrain.protocol.intake.EarlyBuffer` (bounded in bytes per signer and in total) and
are replayed when it opens. An update is kept in the store (for peers that ask for it by id)
once its blob arrived and the window took it, a proposal once the window took it; the shell
prunes both by height. A validator's vote is stored before its
attestation is sent, so it never attests two heads at one height, not even across a crash.

The tick is the role's main step: a tick that raises is recorded for its window and the
next tick (at the next slot, or when a record arrives) goes on from the same state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from p2ptrain.core.envelope import Signed
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.records import Attestation, Proposal, Update
from p2ptrain.errors import ProtocolViolation, TransportError
from p2ptrain.net.gossip import Delivered
from p2ptrain.node.events import Attested, NodeEvent
from p2ptrain.node.failures import FailureBook
from p2ptrain.node.runner import FETCH_ATTEMPTS, RoleRunner
from p2ptrain.node.services import PeerServices
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.intake import EarlyBuffer, window_of
from p2ptrain.protocol.participant import Participant

__all__ = ["ParticipantRunner"]

logger = logging.getLogger(__name__)

#: Bytes of early updates and proposals kept per signer and in all.
EARLY_PER_SIGNER_BYTES = 1 << 20
EARLY_TOTAL_BYTES = 16 << 20


class ParticipantRunner(RoleRunner):
    main_step = "tick"
    machine: Participant

    def __init__(
        self,
        machine: Participant,
        services: PeerServices,
        failures: FailureBook,
        emit: Callable[[NodeEvent], None],
    ) -> None:
        role = "validator" if machine.is_validator else "reducer"
        super().__init__(role, machine, services, failures, emit)
        self._early: EarlyBuffer[Signed[Any]] = EarlyBuffer(
            EARLY_PER_SIGNER_BYTES, EARLY_TOTAL_BYTES
        )

    # -- inputs ---------------------------------------------------------------------------

    def receive_record(self, message: Delivered, record: Any) -> None:
        signed = message.record
        assert isinstance(signed, Signed)
        window = window_of(record)
        if isinstance(record, Update | Proposal) and window and window > self.machine.window:
            signer = peer_id_of(signed.envelope.signer)
            if not self._early.add(signed.record_id, window, signer, len(message.data), signed):
                logger.info("%s for window %d not kept: early buffer full", message.kind, window)
            return
        if isinstance(record, Update):
            self._on_update(signed, record)
        elif isinstance(record, Proposal):
            self._on_proposal(signed, record)
        elif isinstance(record, Attestation):
            self.carry_out(self.machine.receive_attestation(time.monotonic(), signed))

    def _on_update(self, signed: Signed[Update], update: Update) -> None:
        machine = self.machine
        if update.window != machine.window or update.base_head != machine.base.head_id:
            return
        self.spawn(self._fetch_update(signed), "fetching an update", update.window)

    def _on_proposal(self, signed: Signed[Proposal], proposal: Proposal) -> None:
        machine = self.machine
        actions = machine.receive_proposal(time.monotonic(), signed)
        if machine.holds_proposal(signed):
            self.services.remember(signed, "proposal", proposal.window)
        self.carry_out(actions)

    # -- actions --------------------------------------------------------------------------

    def do(self, action: act.Action) -> None:
        services = self.services
        if isinstance(action, act.SendProposal):
            proposal = action.proposal
            self._keep_reduction(proposal.record.head.id)
            services.remember(proposal, "proposal", proposal.record.window)
            services.publish("proposal", proposal)
        elif isinstance(action, act.SendAttestation):
            attestation = action.attestation.record
            own = attestation.validator == services.identity.public_key
            if own:
                services.store.put_vote(attestation.height, attestation.head_id)
                self._keep_reduction(attestation.head_id)
            services.publish("attestation", action.attestation)
            if own:
                self.emit(
                    Attested(
                        peer_id=services.peer_id,
                        height=attestation.height,
                        head_id=attestation.head_id,
                    )
                )
        elif isinstance(action, act.FetchUpdates):
            self.spawn(self._fetch_updates(action), "fetching a proposal's updates")
        else:
            super().do(action)

    def adopted(self, action: act.Adopted) -> None:
        self._replay_early()

    def _keep_reduction(self, head_id: str) -> None:
        """Store the blobs of a head we computed, so peers can fetch them once certified."""
        reduction = self.machine.reduction_of(head_id)
        if reduction is None:
            return
        for blob in (reduction.weights_blob, reduction.optimizer_blob):
            if blob is not None:
                self.services.store.blobs.put(blob)

    def _replay_early(self) -> None:
        for signed in self._early.take(self.machine.window):
            record = signed.record
            if isinstance(record, Update):
                self._on_update(signed, record)
            elif isinstance(record, Proposal):
                self._on_proposal(signed, record)

    # -- fetching -------------------------------------------------------------------------

    async def _fetch_update(self, signed: Signed[Update]) -> None:
        update = signed.record
        for attempt in range(FETCH_ATTEMPTS):
            if self.machine.window != update.window:
                return
            try:
                blob = await self.services.fetch_blob(
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
            actions = self.machine.receive_update(time.monotonic(), signed, blob)
            if self.machine.holds_update(signed.record_id):
                self.services.remember(signed, "update", update.window)
            self.carry_out(actions)
            return

    async def _fetch_updates(self, action: act.FetchUpdates) -> None:
        """Updates a proposal names that we lack: records by id, then their blobs."""
        proposer = peer_id_of(action.peer)
        for update_id in action.update_ids:
            signed = await self.services.fetch_update_record(update_id, proposer)
            if signed is None:
                logger.warning("nobody served update %s named by a proposal", update_id[:12])
                continue
            await self._fetch_update(signed)
