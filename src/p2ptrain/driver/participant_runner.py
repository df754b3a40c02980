"""The reducer and validator roles: collect a window's updates, propose, judge, attest.

The runner ticks the :class:`Participant` on the protocol's slot timers and carries out what
its :class:`~p2ptrain.protocol.policy.ParticipantPolicy` decides: each on-time update's blob
fetched (from its trainer first, then any provider), a proposal's missing updates fetched
from its proposer, early records buffered (bounded) until their window opens, the blobs of
every head it computed kept so peers can fetch them once the head is certified, and a
validator's vote stored before its attestation is sent, so it never attests two heads at
one height, not even across a crash.

The tick is the role's main step: a tick that raises is recorded for its window and the
next tick (at the next slot, or when a record arrives) goes on from the same state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from p2ptrain.core.records import Attestation
from p2ptrain.driver.clock import now as clock
from p2ptrain.driver.failures import FailureBook
from p2ptrain.driver.runner import RoleRunner
from p2ptrain.driver.services import PeerServices
from p2ptrain.observe.events import Attested, NodeEvent
from p2ptrain.protocol.effects import Effect, Publish
from p2ptrain.protocol.participant import Participant

__all__ = ["ParticipantRunner"]

logger = logging.getLogger(__name__)


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
        super().__init__(machine.role.value, machine, services, failures, emit)
        #: The last waiting line logged (each is logged once, without its countdown).
        self._waiting = ""

    def reason(self) -> str:
        return self.machine.catching_up or self.machine.waiting_for(clock())

    def execute(self, effects: Sequence[Effect]) -> None:
        super().execute(effects)
        line = self.machine.waiting_for(clock(), countdown=False)
        if line != self._waiting and not self.machine.catching_up:
            self._waiting = line
            logger.info("%s: %s", self.role, line)

    def observe(self, now: float) -> None:
        """Tell the participant when each trainer of the peer book was last heard from (the
        trainers it still expects to report; see :meth:`Participant.heard_from`)."""
        machine = self.machine
        if machine.presence_timeout_s is None:
            return
        net = self.services.net
        if "trainer" in net.roles:  # our own trainer reports through the loop-back
            machine.heard_from(machine.key, now)
        for record in net.known_peers():
            if "trainer" not in record.roles:
                continue
            when = net.last_heard(record.peer_id, now)
            if when is not None:
                machine.heard_from(record.public_key, when)

    def published(self, effect: Publish) -> None:
        record = getattr(effect.record, "record", None)
        if isinstance(record, Attestation) and record.validator == self.machine.key:
            self.emit(
                Attested(
                    peer_id=self.services.peer_id,
                    height=record.height,
                    head_id=record.head_id,
                    round=record.round,
                    stage=record.stage,
                )
            )
