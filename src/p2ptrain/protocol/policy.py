"""The effect policy: how a node acts on what its role machines decide, sans IO.

The window state machines (:mod:`.follower`, :mod:`.trainer`, :mod:`.participant`) say
*what* the protocol needs -- an update to send, a head's weights to fetch -- as actions
(:mod:`.actions`). The policy decides *how*, the same way in a node and in the simulator,
and answers with effects (:mod:`.effects`) for a transport to carry out:

* **what is kept before what is sent** -- an update's blob before the update, a
  validator's vote before its attestation, the blobs of a head it computed before it
  proposes or attests that head; a record a peer may ask for is kept once the window took
  it, never on arrival;
* **early records** -- updates and proposals for the window after the open one wait in an
  :class:`~.intake.EarlyBuffer` (bounded per signer and in total) and are replayed when it
  opens; anything further ahead never reaches the policy (:mod:`.intake`);
* **whom to ask** -- an update's blob from its trainer first, a proposal's updates from the
  proposer, a head's weights from the peer that sent its certificate, then anyone;
* **retry and back-off** -- a fetch that failed in transit is tried again after 0.5, 1, 2,
  ... s (at most 5 s) while what it is for is still needed, a bounded number of times; one
  answered with bytes proven wrong is not (the fetcher already blamed the provider);
* **catch-up** -- a certificate more than one height ahead fetches the chain from its sender,
  one page at a time (one catch-up in flight); a state nobody serves is given up after
  :data:`STATE_ATTEMPTS` tries, said once (a :class:`~.actions.Notice`), and asked for
  again every :data:`CATCH_UP_RETRY_S` while the base is behind;
* **anti-entropy** -- a participant whose window is stuck past its deadline asks its peers
  which of the window's records they hold and fetches those it lacks (:class:`WindowSync`;
  a failed sync is not retried, the next slot asks again); a trainer's update that no
  proposal named in time is sent once more.

Inputs carry ``now``; each returns the effects to carry out, in order. One policy wraps one
role machine; a node of several roles runs one per machine.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from p2ptrain.core.certificate import CertifiedLink, QuorumCertificate
from p2ptrain.core.envelope import Signed
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.records import Attestation, Head, Proposal, Update
from p2ptrain.core.spool import Blob
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.chain import ChainPage
from p2ptrain.protocol.effects import (
    AggregateFetch,
    BlobFetch,
    ChainFetch,
    Effect,
    Fetch,
    KeepState,
    Publish,
    RecordFetch,
    Request,
    StateFetch,
    StoreBlob,
    StoreRecord,
    StoreVote,
    TrainLater,
    WindowSync,
)
from p2ptrain.protocol.intake import EarlyBuffer, window_of
from p2ptrain.protocol.participant import Participant
from p2ptrain.protocol.role import RoleMachine
from p2ptrain.protocol.trainer import TrainerMachine

__all__ = [
    "CATCH_UP_RETRY_S",
    "EARLY_PER_SIGNER_BYTES",
    "EARLY_TOTAL_BYTES",
    "FETCH_ATTEMPTS",
    "NAMED_ATTEMPTS",
    "ParticipantPolicy",
    "RolePolicy",
    "TrainerPolicy",
    "backoff",
    "policy_for",
    "train_backoff",
]

#: Tries of an update's blob or record before it is given up (the window goes on).
FETCH_ATTEMPTS = 6
#: Tries of a certified head's weights (then the node's periodic sync catches up).
STATE_ATTEMPTS = 12
#: Tries of a head's aggregate before fetching its full state instead.
AGGREGATE_ATTEMPTS = 3
#: After a state nobody served, how long before it is asked for again (a newer head's
#: certificate or a sync page asks sooner).
CATCH_UP_RETRY_S = 10.0
#: A catch-up page asked for this long ago without an answer no longer holds others up.
_CHAIN_FETCH_STALE_S = 60.0
#: After this many tries a fetch asks anyone, not the peers named first.
NAMED_ATTEMPTS = 2
#: Bytes of early updates and proposals kept per signer and in all.
EARLY_PER_SIGNER_BYTES = 1 << 20
EARLY_TOTAL_BYTES = 16 << 20
#: The longest wait before training a window that failed again.
TRAIN_RETRY_MAX_S = 30.0


def backoff(attempt: int) -> float:
    """Seconds before try ``attempt + 1`` of a fetch that failed in transit."""
    return min(5.0, 0.5 * 2.0**attempt)


def train_backoff(failures_in_a_row: int) -> float:
    """Seconds before training a window again after it raised this many times in a row."""
    return min(TRAIN_RETRY_MAX_S, 2.0**failures_in_a_row)


class RolePolicy:
    """The policy of a role machine that follows the chain (seeds, viewers; the base of the
    trainer's and participant's)."""

    def __init__(self, machine: RoleMachine) -> None:
        self.machine = machine
        self._fetching_states: set[str] = set()
        #: When the catch-up page in flight was asked for (None: none is).
        self._chain_asked: float | None = None
        #: When to ask again for a state nobody served (None: nothing to resume).
        self._resume_at: float | None = None

    # -- inputs -----------------------------------------------------------------------

    def start(self, now: float) -> list[Effect]:
        """The node is up and its stored chain restored."""
        return []

    def tick(self, now: float) -> list[Effect]:
        effects = self.carry(now, self.machine.tick(now))
        if self._resume_at is not None and now >= self._resume_at and not self._fetching_states:
            self._resume_at = None
            effects += self.carry(now, self.machine.resume_catch_up())
        return effects

    def certificate(
        self, now: float, head: Head, certificate: QuorumCertificate, sender: bytes
    ) -> list[Effect]:
        return self.carry(now, self.machine.receive_certificate(now, head, certificate, sender))

    def record(self, now: float, signed: Signed[Any], size: int) -> list[Effect]:
        """An update, proposal or attestation that passed intake (``size``: its bytes)."""
        return []

    def links(self, now: float, page: ChainPage) -> list[Effect]:
        """A catch-up page (from our own fetch or the node's periodic sync): verify and
        adopt its links, then ask for what follows."""
        return self.carry(now, self.machine.receive_links(now, page))

    def fetched(self, now: float, request: Request, answer: Any) -> list[Effect]:
        """A fetch succeeded: ``answer`` is the blob, the signed record, the
        ``(weights, optimizer)`` pair or the :class:`~.chain.ChainPage`."""
        if isinstance(request, StateFetch):
            self._fetching_states.discard(request.head_id)
            weights, optimizer = answer
            return self.carry(
                now, self.machine.receive_state(now, request.head_id, weights, optimizer)
            )
        if isinstance(request, AggregateFetch):
            self._fetching_states.discard(request.head_id)
            return self.carry(now, self.machine.receive_aggregate(now, request.head_id, answer))
        if isinstance(request, ChainFetch):
            self._chain_asked = None
            assert isinstance(answer, ChainPage)
            return self.links(now, answer)
        return []

    def fetch_failed(self, now: float, request: Request, *, proven_bad: bool) -> list[Effect]:
        """A fetch failed: in transit (``proven_bad`` False: try again later) or because
        every answer was proven wrong (the providers were blamed; not tried again)."""
        if isinstance(request, StateFetch):
            machine = self.machine
            link = machine.chain.at(request.head.height)
            others = self._fetching_states - {request.head_id}
            needed = (
                link is not None
                and link.head_id == request.head_id
                and machine.base.head.height < request.head.height
                and (link.head_id == machine.chain.tip.head_id or not others)
            )
            if needed and request.attempt + 1 < STATE_ATTEMPTS:
                return [self._again(request)]
            self._fetching_states.discard(request.head_id)
            if needed:  # nobody serves it: said once, asked for again after a while
                self._resume_at = now + CATCH_UP_RETRY_S
                return self.carry(now, machine.state_unavailable(request.head, request.head_id))
        elif isinstance(request, ChainFetch):
            # the next page did not come: go on towards the tip of what was verified
            self._chain_asked = None
            return self.carry(now, self.machine.resume_catch_up())
        elif isinstance(request, AggregateFetch):
            machine = self.machine
            link = machine.chain.at(request.head.height)
            needed = (
                link is not None
                and link.head_id == request.head_id
                and machine.base.head.height < request.head.height
            )
            if needed and not proven_bad and request.attempt + 1 < AGGREGATE_ATTEMPTS:
                return [self._again(request)]
            self._fetching_states.discard(request.head_id)
            if needed:  # nobody serves the aggregate: the tip's full state will do
                tip = machine.chain.tip
                return self.carry(now, [act.FetchState(None, tip.head, tip.head_id)])
        return []

    # -- actions into effects ---------------------------------------------------------

    def carry(self, now: float, actions: Sequence[act.Action]) -> list[Effect]:
        effects: list[Effect] = []
        for action in actions:
            effects += self.effects_of(now, action)
        return effects

    def effects_of(self, now: float, action: act.Action) -> list[Effect]:
        if isinstance(action, act.SendCertificate):
            link = CertifiedLink(head=action.head, certificate=action.certificate)
            return [Publish("certificate", link)]
        if isinstance(action, act.FetchState | act.FetchAggregate):
            if action.head_id in self._fetching_states:
                return []  # one fetch of a head's state (whole or by aggregate) at a time
            self._fetching_states.add(action.head_id)
            first = () if action.peer is None else (peer_id_of(action.peer),)
            kind = StateFetch if isinstance(action, act.FetchState) else AggregateFetch
            return [Fetch(kind(action.head, action.head_id, first))]
        if isinstance(action, act.FetchChain):
            fetch = self._chain_fetch(now, peer_id_of(action.peer), action.after_height)
            return [] if fetch is None else [fetch]
        if isinstance(action, act.Adopted):
            # the head's state and aggregate are kept before the transport stores the head
            return [*self._keep_head(action), action, *self.adopted(now, action)]
        if isinstance(action, act.Reported | act.Notice | act.Train):
            return [action]
        raise TypeError(f"{type(self.machine).__name__} has no use for {type(action).__name__}")

    def _keep_head(self, action: act.Adopted) -> list[Effect]:
        """An adopted head's state (encoded only if the transport lacks it) and aggregate
        (peers that hold its parent fetch only that)."""
        head, head_id, machine = action.head, action.head_id, self.machine
        effects: list[Effect] = [KeepState(head, functools.partial(machine.state_of, head_id))]
        aggregate = machine.aggregate_of(head_id)
        if aggregate is not None and head.aggregate_blob is not None:
            effects.append(StoreBlob(aggregate, head.aggregate_blob))
        return effects

    def _chain_fetch(self, now: float, peer: str | None, after: int) -> Fetch | None:
        """A catch-up page to ask for, unless one is in flight (its answer asks for the
        next page itself)."""
        if self._chain_asked is not None and now - self._chain_asked < _CHAIN_FETCH_STALE_S:
            return None
        self._chain_asked = now
        return Fetch(ChainFetch(peer, after))

    def adopted(self, now: float, action: act.Adopted) -> list[Effect]:
        """The machine moved to a new canonical head (after the transport learnt of it)."""
        return []

    def base_moved(self, now: float, action: act.Adopted) -> list[Effect]:
        """Another role of the node moved the follower this role shares to a new head."""
        return self.carry(now, self.machine.on_base(now)) + self.adopted(now, action)

    @staticmethod
    def _again(request: BlobFetch | RecordFetch | StateFetch | AggregateFetch) -> Fetch:
        attempt = request.attempt + 1
        if (
            isinstance(request, BlobFetch | StateFetch | AggregateFetch)
            and attempt >= NAMED_ATTEMPTS
        ):
            request = replace(request, first=())
        return Fetch(replace(request, attempt=attempt), backoff(request.attempt))


class TrainerPolicy(RolePolicy):
    machine: TrainerMachine

    def __init__(self, machine: TrainerMachine) -> None:
        super().__init__(machine)

    def start(self, now: float) -> list[Effect]:
        if self.machine.chain.height == 0:
            return self.carry(now, self.machine.start(now))
        return []  # a restored chain adopted its tip, which asked to train its window

    def trained(
        self, now: float, train: act.Train, blob: bytes, loss_before: float, loss_after: float
    ) -> list[Effect]:
        """The transport trained ``train`` and encoded ``blob``."""
        return self.carry(
            now,
            self.machine.finish(
                train.window, train.base_head, blob, loss_before, loss_after, now=now
            ),
        )

    def train_failed(self, now: float, train: act.Train, failures_in_a_row: int) -> list[Effect]:
        """Training raised: offer the same window again after a back-off (2, 4, ... s)."""
        return [TrainLater(train, train_backoff(failures_in_a_row))]

    def train_due(self, now: float, train: act.Train) -> list[Effect]:
        """The back-off passed: train again unless a newer head came first."""
        return [train] if self.machine.training(train) else []

    def record(self, now: float, signed: Signed[Any], size: int) -> list[Effect]:
        if isinstance(signed.record, Proposal):
            self.machine.saw_proposal(signed)
        return []

    def effects_of(self, now: float, action: act.Action) -> list[Effect]:
        if isinstance(action, act.SendUpdate):
            # the blob is kept first: peers fetch it as soon as they see the update
            publish = Publish("update", action.update, action.blob, again=action.again)
            return [StoreBlob(action.blob), publish]
        return super().effects_of(now, action)


class ParticipantPolicy(RolePolicy):
    """A reducer's or validator's policy (see the module docstring)."""

    machine: Participant

    def __init__(self, machine: Participant) -> None:
        super().__init__(machine)
        self.early: EarlyBuffer[Signed[Any]] = EarlyBuffer(
            EARLY_PER_SIGNER_BYTES, EARLY_TOTAL_BYTES
        )
        self._fetching_updates: set[str] = set()
        self._fetching_window = machine.window

    def record(self, now: float, signed: Signed[Any], size: int) -> list[Effect]:
        record = signed.record
        window = window_of(record)
        if isinstance(record, Update | Proposal) and window and window > self.machine.window:
            self.early.add(
                signed.record_id, window, peer_id_of(signed.envelope.signer), size, signed
            )
            return []  # refused when full: a proposal names it, and it is fetched then
        if isinstance(record, Update):
            if window and window < self.machine.window:
                self.machine.late_update(now, signed)  # its trainer is expected; no fetch
                return []
            return self._update(signed)
        if isinstance(record, Proposal):
            return self._proposal(now, signed)
        if isinstance(record, Attestation):
            return self.carry(now, self.machine.receive_attestation(now, signed))
        return []

    def _update(self, signed: Signed[Update]) -> list[Effect]:
        machine, update = self.machine, signed.record
        if update.window != machine.window or update.base_head not in machine.window_bases():
            return []
        if self._fetching_window != machine.window:
            self._fetching_updates.clear()
            self._fetching_window = machine.window
        if signed.record_id in self._fetching_updates or machine.holds_update(signed.record_id):
            return []
        self._fetching_updates.add(signed.record_id)
        return [Fetch(BlobFetch(signed, (update.trainer_id,)))]

    def _proposal(self, now: float, signed: Signed[Proposal]) -> list[Effect]:
        actions = self.machine.receive_proposal(now, signed)
        kept: list[Effect] = []
        if self.machine.holds_proposal(signed):
            kept.append(StoreRecord(signed, "proposal", signed.record.window))
        return kept + self.carry(now, actions)

    def fetched(self, now: float, request: Request, answer: Any) -> list[Effect]:
        if isinstance(request, BlobFetch):
            signed = request.update
            self._fetching_updates.discard(signed.record_id)
            if signed.record.window != self.machine.window:
                return []
            actions = self.machine.receive_update(now, signed, answer)
            kept: list[Effect] = []
            if self.machine.holds_update(signed.record_id):
                kept.append(StoreRecord(signed, "update", signed.record.window))
            return kept + self.carry(now, actions)
        if isinstance(request, RecordFetch):
            signed = answer
            assert isinstance(signed, Signed) and isinstance(signed.record, Update)
            if signed.record.window != self.machine.window:
                return []
            first = (request.proposer, signed.record.trainer_id)
            return [Fetch(BlobFetch(signed, first))]
        if isinstance(request, WindowSync):
            # records peers hold and we lacked: verified and through intake, as from gossip
            effects: list[Effect] = []
            for signed in answer:
                effects += self.record(now, signed, 0)
            return effects
        return super().fetched(now, request, answer)

    def fetch_failed(self, now: float, request: Request, *, proven_bad: bool) -> list[Effect]:
        if isinstance(request, BlobFetch | RecordFetch):
            window = (
                request.update.record.window if isinstance(request, BlobFetch) else request.window
            )
            still = window == self.machine.window
            if still and not proven_bad and request.attempt + 1 < FETCH_ATTEMPTS:
                return [self._again(request)]
            update_id = (
                request.update.record_id if isinstance(request, BlobFetch) else request.update_id
            )
            self._fetching_updates.discard(update_id)
            if not still:
                return []
            return self.carry(now, self.machine.update_unavailable(now, update_id))
        return super().fetch_failed(now, request, proven_bad=proven_bad)

    def effects_of(self, now: float, action: act.Action) -> list[Effect]:
        if isinstance(action, act.SendProposal):
            proposal = action.proposal
            return [
                *self._keep_reduction(proposal.record.head.id),
                StoreRecord(proposal, "proposal", proposal.record.window),
                Publish("proposal", proposal),
            ]
        if isinstance(action, act.SendAttestation):
            attestation = action.attestation.record
            if attestation.validator != self.machine.key:  # relayed (a polka that locked us)
                return [Publish("attestation", action.attestation, again=action.again)]
            # the vote is persisted before anyone hears of it: never two heads in a round
            ballot = action.ballot
            stored = () if ballot is None else (StoreVote(attestation.height, ballot),)
            return [
                *stored,
                *self._keep_reduction(attestation.head_id),
                Publish("attestation", action.attestation, again=action.again),
            ]
        if isinstance(action, act.SyncWindow):
            # the window may also be stuck because a certificate was lost: ours goes out
            # again (whoever missed it catches up; peers that saw it drop it as seen), and
            # we ask whether the chain moved past us
            machine = self.machine
            first = tuple(peer_id_of(key) for key in action.proposers)
            sync = WindowSync(action.window, machine.held_records(), first)
            effects: list[Effect] = [Fetch(sync)]
            chain_fetch = self._chain_fetch(now, None, machine.chain.height)
            if chain_fetch is not None:
                effects.append(chain_fetch)
            tip = machine.chain.tip
            if tip.certificate is not None:
                link = CertifiedLink(head=tip.head, certificate=tip.certificate)
                effects.append(Publish("certificate", link, again=True))
            return effects
        if isinstance(action, act.FetchUpdates):
            proposer = peer_id_of(action.peer)
            window = self.machine.window
            return [Fetch(RecordFetch(i, proposer, window)) for i in action.update_ids]
        if isinstance(action, act.Adopted):
            # the head's blobs are kept before the transport stores the head
            return [*self._keep_reduction(action.head_id), *super().effects_of(now, action)]
        return super().effects_of(now, action)

    def _keep_reduction(self, head_id: str) -> list[Effect]:
        """The blobs of a head we computed: peers fetch them once it is certified."""
        reduction = self.machine.reduction_of(head_id)
        if reduction is None:
            return []
        head = reduction.head
        assert head is not None  # a reduction kept by head id made one
        blobs: list[tuple[Blob | None, str | None]] = [
            (reduction.weights_blob, head.weights_blob),
            (reduction.optimizer_blob, head.optimizer_blob),
        ]
        return [StoreBlob(blob, blob_id) for blob, blob_id in blobs if blob is not None]

    def adopted(self, now: float, action: act.Adopted) -> list[Effect]:
        """A new window opened: replay what arrived early for it."""
        effects: list[Effect] = []
        for signed in self.early.take(self.machine.window):
            effects += self.record(now, signed, 0)
        return effects


def policy_for(machine: RoleMachine) -> RolePolicy:
    """The policy of ``machine``'s role."""
    if isinstance(machine, Participant):
        return ParticipantPolicy(machine)
    if isinstance(machine, TrainerMachine):
        return TrainerPolicy(machine)
    return RolePolicy(machine)
