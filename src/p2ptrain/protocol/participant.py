"""The reducer and validator window state machines (DESIGN §4 steps 4-7).

The window's phase changes only by a row of :data:`.lifecycle.TRANSITIONS`: this module
turns inputs into the table's events (:meth:`Participant._fire`) and does the effects; a
reducer and a validator differ by their rows, not by branches here.

A participant collects the updates of the open window (those built on its canonical head),
and after the deadline walks the proposer slots (:mod:`.proposers`):

* in its own slot it reduces its cohort -- the first ``max_updates`` updates that arrived
  before the deadline -- and proposes the head (a validator also attests its own proposal);
* a validator judges each proposal from a proposer whose slot has opened by recomputing the
  proposal's cohort itself (fetching updates it lacks from the proposer); it attests the
  first whose head, accepted and rejected sets and aggregate all match (its *prevote*, in the
  round the clock says); a proposer caught with a wrong head is reported and, if a reducer,
  dropped from the pool. While an opened slot's proposal is on its way, a validator reduces
  its own cohort (``PREPARE``): the proposal, when it names that cohort, is judged from the
  reduction kept, so the proposer's reduction and the validators' run side by side;
* a validator votes in rounds (:mod:`.ballot`): once q validators prevoted one head in its
  round it commits that head and locks on it; q commits of one round are the certificate.
  Each pass of the proposers' slots is a round, and a validator follows others into a later
  round once more than ``n - q`` of them voted there. In a new round it prevotes its lock,
  or, unlocked, the head q validators prevoted in that round or the earliest valid proposal
  it holds (proposals it could not check are judged again): a split vote ends;
* when the slots run out without a certificate they start over: a validator that voted
  sends its votes of the round again (lost messages), one that did not judges again;
* from the end of the first slot on, every ``SYNC_EVERY_SLOTS`` slots, a participant that
  still waits for something (it has not voted; a reducer, has not proposed) asks its peers
  which updates and proposals of the window they hold and fetches what it lacks
  (:class:`SyncWindow`): what a crash or a partition lost is repaired once it heals.

A window closes early when it is full: once ``max_updates`` updates have arrived, or a
proposal naming ``max_updates`` updates arrives, the deadline is now (nobody can be left out
of a full window, so waiting would only waste the time of everyone who is done). It also
closes early, with at least ``min_updates`` updates, once every *expected* trainer has
reported (its update arrived, accepted or not): a trainer is expected when it reported in
the window before (its update reached us, in time or late; so the heads it was accepted in
too) and the node has heard from it within ``presence_timeout_s``
(:meth:`Participant.heard_from`: a record, or its presence on the network, directly or
through a peer). A peer record alone makes nobody expected (anyone can sign one), and a
trainer that missed a window's early close is expected in the next, so it is not left out
window after window. One alive but slow keeps the window open until its deadline, as before.
Without presence (``presence_timeout_s`` None: the simulator, or a node told to wait for
every deadline) only a full window closes early; with no trainer known from the window
before (the first window, or a node that just started), neither does it.

While the window waits, :meth:`Participant.waiting_for` says for what: how many of the
expected updates arrived and who is still to report, which proposal is awaited, or why no
update passed screening.

Everyone counts attestations (:class:`AttestationBook`); q of them for one head make a
certificate, sent to every peer. Decisions carry reasons; :meth:`statistics` sums them up.

A participant given a ``timer`` (the node passes :func:`time.perf_counter`) times each
reduction it computes and keeps the last as :attr:`Participant.last_reduction`, for people
(the node's status and metrics). Wall seconds differ from run to run, so they decide nothing
and enter no record, report or hash; the simulator gives no timer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from p2ptrain.core.certificate import Verdict
from p2ptrain.core.envelope import Signed, seal
from p2ptrain.core.identity import Identity, peer_id_of
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Attestation, Proposal, Update
from p2ptrain.core.spool import BlobSpool
from p2ptrain.protocol.actions import (
    Action,
    FetchUpdates,
    Reported,
    SendAttestation,
    SendCertificate,
    SendProposal,
    SyncWindow,
)
from p2ptrain.protocol.ballot import Ballot
from p2ptrain.protocol.follower import ChainRole, Follower, FollowerStatistics
from p2ptrain.protocol.leases import LeaseBook
from p2ptrain.protocol.lifecycle import WALKING, Effect, Event, Phase, Role, transition
from p2ptrain.protocol.presence import Presence
from p2ptrain.protocol.proposers import proposer_order, slot_at, slot_start
from p2ptrain.protocol.quorum import AttestationBook
from p2ptrain.protocol.reduction import (
    BaseState,
    ByteSource,
    Reduction,
    Submission,
    belongs_to_window,
    reduce_window,
)

__all__ = ["SYNC_EVERY_SLOTS", "Participant", "ParticipantStatistics", "ReductionTiming"]

#: A participant still waiting asks its peers what the window holds every this many slots.
SYNC_EVERY_SLOTS = 2


@dataclass(frozen=True, slots=True)
class ParticipantStatistics(FollowerStatistics):
    window: int
    #: Windows reduced to a head (our own cohort, or a proposal's we recomputed).
    reductions: int
    updates: int
    proposals_judged: int
    proposals_wrong: int
    attested: str | None
    dropped_reducers: int
    equivocations: int


@dataclass(frozen=True, slots=True)
class ReductionTiming:
    """How long a participant's reductions took, in wall seconds as its timer read them:
    for people (status, metrics), never in a record, a report or anything hashed."""

    #: The last reduction: the window it reduced, its wall seconds, the updates it accepted.
    window: int
    seconds: float
    accepted: int
    #: Reductions timed since the participant was built (a cohort reduced again is served
    #: from the cache, not timed), and their wall seconds in all.
    count: int
    total_seconds: float


@dataclass
class _Window:
    base: BaseState
    opened_at: float
    deadline_at: float
    order: tuple[bytes, ...]
    #: The heads this window's updates may build on (the base first; see staleness).
    bases: tuple[str, ...]
    updates: dict[str, Submission] = field(default_factory=dict)
    arrival: list[str] = field(default_factory=list)  # update ids, first arrival first
    before_deadline: int = 0
    proposals: dict[bytes, Signed[Proposal]] = field(default_factory=dict)
    judged: dict[bytes, Verdict] = field(default_factory=dict)
    fetching: dict[bytes, frozenset[str]] = field(default_factory=dict)
    #: Where the window is in its life (changed only by :data:`.lifecycle.TRANSITIONS`).
    phase: Phase = Phase.OPEN
    #: The last slot whose opening was taken (-1: none yet, or since a restart).
    slot: int = -1
    #: Proposers whose proposal named an update nobody delivered (judged again next round).
    unchecked: set[bytes] = field(default_factory=set)


class Participant(ChainRole):
    """A reducer (``validator=False``: proposes, never attests) or a validator, over the
    node's follower (``follow``; or the genesis weights, for a participant alone). The heads
    it reduces are the follower's known states: adopting one needs no second outer step.
    ``timer``: what times each reduction, in seconds (the node's :func:`time.perf_counter`;
    None: not timed, as in the simulator, whose reports are compared byte for byte).
    ``spool``: where reductions write their heads' blobs (the node's blob store, so they
    cost no memory and it adopts them without a copy; None: in memory)."""

    def __init__(
        self,
        manifest: ExperimentManifest,
        identity: Identity,
        follow: Mapping[str, torch.Tensor] | Follower,
        *,
        validator: bool,
        reducers: Sequence[bytes],
        now: float = 0.0,
        presence_timeout_s: float | None = None,
        timer: Callable[[], float] | None = None,
        spool: BlobSpool | None = None,
    ) -> None:
        super().__init__(self.follower_of(manifest, identity, follow))
        if self.follower.state_source is not None:
            raise ValueError("a node holds one participant (reducer, validator or both)")
        self.follower.state_source = self._known_state
        #: Who is expected to report in the open window (the early close).
        self.presence = Presence(presence_timeout_s, manifest.window.max_updates)
        #: A reducer and a validator differ only by their rows of the lifecycle table.
        self.role = Role.VALIDATOR if validator else Role.REDUCER
        self.reducers = tuple(reducers)
        self.leases = LeaseBook(manifest)
        self.book = AttestationBook(manifest, self.experiment_id)
        self.dropped: set[bytes] = set()
        self.votes: dict[int, Ballot] = {}  # height -> what we voted there, round by round
        self._reductions: dict[frozenset[str], Reduction] = {}
        self._by_head: dict[str, Reduction] = {}
        #: The reduction of the head adopted last, if we computed it (its blobs are kept
        #: by the driver after the adoption that opened the next window).
        self._adopted_reduction: Reduction | None = None
        self.last_reason = "window open"
        self.judged_count = 0
        self.wrong_count = 0
        self.reductions = 0
        self._timer = timer
        #: Where reductions write the blobs of their heads (None: in memory).
        self._spool = spool
        self._last_reduction: ReductionTiming | None = None
        self._open(self.base, now)

    # --- window lifecycle ----------------------------------------------------------------

    def _open(self, base: BaseState, now: float) -> None:
        """Open the window built on ``base`` (in phase OPEN; attested at once if we voted at
        its height before a restart)."""
        closing: _Window | None = getattr(self, "_window", None)
        follows = closing is not None and closing.base.window + 1 == base.window
        self.presence.new_window(
            s.update.trainer for s in (closing.updates.values() if closing and follows else ())
        )
        order = proposer_order(
            self.manifest, self.experiment_id, base.window, self.reducers, self.dropped
        )
        self._adopted_reduction = self._by_head.get(base.head_id)
        self._reductions.clear()
        self._by_head.clear()
        self.book.forget_through(base.head.height)
        deadline = now + self.manifest.window.deadline_s
        self._window = _Window(
            base=base,
            opened_at=now,
            deadline_at=deadline,
            order=order,
            bases=self.window_bases(),
        )
        if base.window in self.votes:
            self._fire(now, Event.VOTED, [])

    def restart(self, now: float) -> None:
        """After a crash: the chain, weights and votes persisted; the open window's updates
        and proposals were in memory and are gone, so the window restarts at ``now`` (and
        votes from the round after the stored one)."""
        self.votes = {height: b.after_restart() for height, b in self.votes.items()}
        self._open(self.base, now)

    def restore_votes(self, stored: Mapping[int, Ballot], now: float) -> None:
        """The ballots a node stored before it stopped (see :meth:`restart`)."""
        self.votes.update(stored)
        self.restart(now)

    def on_base(self, now: float) -> list[Action]:
        actions: list[Action] = []
        self._fire(now, Event.ADOPTED, actions)
        self.last_reason = f"window {self.base.window} open on {self.base.head_id[:12]}"
        return actions

    def _fire(
        self, now: float, event: Event, actions: list[Action], head_id: str | None = None
    ) -> tuple[Effect, ...]:
        """Take ``event``'s row of the lifecycle table: the window's new phase, then the
        effects done here; the walk's effects (WALK, PROPOSE, SKIP, STOP) are returned for
        the caller to follow."""
        w = self._window
        step = transition(self.role, w.phase, event)
        w.phase = step.phase
        height = w.base.window
        for effect in step.effects:
            if effect in (Effect.JOIN, Effect.JOIN_UNPROPOSED):
                if effect is Effect.JOIN or not w.proposals:
                    w.before_deadline = len(w.arrival)
            elif effect is Effect.CLOSE:
                if now < w.deadline_at:
                    w.deadline_at = now
                    why = "full" if event is Event.FULL else "every expected trainer reported"
                    self.last_reason = f"window {height} {why}: closed early"
            elif effect is Effect.START:
                # the deadline runs from the first update: the others get as long as it took
                # nobody to start, download or join (and a window that expired empty -- what
                # was sent was lost, or it opened here long before elsewhere -- gives them a
                # full deadline too, or each proposer would propose the little that reached it)
                w.deadline_at = now + self.manifest.window.deadline_s
                w.slot = -1
                self.last_reason = f"window {height}: first update; the deadline runs from now"
            elif effect is Effect.SYNC:
                actions.append(SyncWindow(height, self._missing_proposals(now)))
            elif effect is Effect.RESEND:
                actions += self._resend(height)
            elif effect is Effect.PREPARE:
                # while the proposer reduces, so do we: its proposal, when it names our
                # cohort, is judged from the reduction kept here
                self._reduce(self._cohort())
            elif effect is Effect.VOTE:
                assert head_id is not None
                actions += self._vote(now, height, head_id)
            elif effect is Effect.NEXT:
                self._open(self.base, now)
        return step.effects

    def _missing_proposals(self, now: float) -> tuple[bytes, ...]:
        """The proposers (not us) whose slot opened and whose proposal we do not hold."""
        w = self._window
        opened = w.order[: max(0, min(self._slot(now), len(w.order) - 1)) + 1]
        return tuple(p for p in opened if p != self.key and p not in w.proposals)

    def _known_state(self, head_id: str) -> BaseState | None:
        reduction = self._by_head.get(head_id)
        if reduction is None or reduction.head is None or reduction.weights is None:
            return None
        return BaseState(
            reduction.head,
            head_id,
            reduction.weights,
            reduction.optimizer_state,
            reduction.aggregate_blob,
        )

    @property
    def window(self) -> int:
        return self._window.base.window

    @property
    def last_reduction(self) -> ReductionTiming | None:
        """The last reduction this participant computed and how long it took (None: none
        yet, or no timer)."""
        return self._last_reduction

    @property
    def phase(self) -> Phase:
        """Where the open window is in its life (:mod:`.lifecycle`)."""
        return self._window.phase

    def next_wakeup(self, now: float) -> float:
        """The next time after ``now`` that :meth:`tick` has something to do: the deadline
        (slot 0 opens), then each following slot boundary."""
        slot = self._slot(now) + 1
        when = self._slot_start(slot)
        if when <= now:  # ``now`` is a boundary that rounding placed in the slot before
            when = self._slot_start(slot + 1)
        lapse = self._next_lapse(now)
        return when if lapse is None else min(when, lapse)

    def _slot_start(self, index: int) -> float:
        return slot_start(self.manifest, self._window.deadline_at, index)

    def _slot(self, now: float) -> int:
        """The slot open at ``now`` (-1 before the deadline); slots repeat past the end."""
        return slot_at(self.manifest, self._window.deadline_at, now)

    # --- expected trainers ---------------------------------------------------------------

    @property
    def presence_timeout_s(self) -> float | None:
        return self.presence.timeout_s

    def heard_from(self, trainer: bytes, when: float) -> None:
        """The node heard from ``trainer`` at ``when`` (a record, or its presence)."""
        self.presence.heard_from(trainer, when)

    def _reported(self) -> frozenset[bytes]:
        return frozenset(s.update.trainer for s in self._window.updates.values())

    def _all_reported(self, now: float) -> bool:
        """Whether the window may close early: ``min_updates`` arrived and every expected
        trainer reported (never without presence, never after the deadline)."""
        w = self._window
        if now >= w.deadline_at:
            return False
        arrived = self.presence.counts(len(w.arrival), self.manifest.window.min_updates)
        return arrived and self.presence.all_reported(now, self._reported())

    def _next_lapse(self, now: float) -> float | None:
        """When the next expected trainer that has not reported stops being expected (the
        window may then close early), if that can matter before the deadline."""
        w = self._window
        if now >= w.deadline_at:
            return None
        if not self.presence.counts(len(w.arrival), self.manifest.window.min_updates):
            return None
        return self.presence.next_lapse(now, self._reported())

    def waiting_for(self, now: float, *, countdown: bool = True) -> str:
        """What the open window waits for, in words (the status, dashboard and log;
        ``countdown=False`` leaves the time to the deadline out, for logging changes)."""
        w = self._window
        height = w.base.window
        if w.phase in (Phase.PROPOSED, Phase.ATTESTED):
            return self.last_reason
        m = self.manifest.window
        if now < w.deadline_at:
            count = len(w.arrival)
            left = (
                f"deadline in {w.deadline_at - now:.0f} s" if countdown else "before the deadline"
            )
            if self.presence_timeout_s is None:
                return (
                    f"window {height}: {count} updates (min {m.min_updates}, max "
                    f"{m.max_updates}), {left}"
                )
            reported = self._reported()
            expected = self.presence.expected(now)
            if not self.presence.reporters_before:  # nobody known from the window before
                return (
                    f"window {height}: {count} updates (min {m.min_updates}, max "
                    f"{m.max_updates}), {left}"
                )
            missing = sorted(peer_id_of(k)[:12] for k in expected - reported)
            line = (
                f"window {height}: {count} of {len(expected | reported)} expected updates "
                f"(min {m.min_updates}), {left}"
            )
            if missing:
                return f"{line}; waiting for trainers {', '.join(missing)}"
            return f"{line}; waiting for updates"
        if not w.arrival:
            return (
                f"window {height}: no update arrived by the deadline; waiting for a first "
                f"one (the deadline runs from it)"
            )
        if self.last_reason.startswith("no proposal"):
            return f"window {height}: {self.last_reason}"
        opened = w.order[: max(0, min(self._slot(now), len(w.order) - 1)) + 1]
        for proposer in opened:
            name = peer_id_of(proposer)[:12]
            if proposer in w.fetching:
                count = len(w.fetching[proposer])
                return f"window {height}: fetching {count} updates named by {name}'s proposal"
            if proposer not in w.proposals and proposer != self.key:
                return f"window {height}: waiting for a proposal from {name}"
        return self.last_reason

    # --- inputs --------------------------------------------------------------------------

    def late_update(self, now: float, signed: Signed[Update]) -> None:
        """An update (its envelope verified) for a window before the open one: its trainer
        may be expected from now on (:meth:`.Presence.late`)."""
        behind = self._window.base.window - signed.record.window
        self.presence.late(now, signed.record.trainer, behind)

    def receive_update(
        self, now: float, signed: Signed[Update], blob: bytes | bytearray | ByteSource
    ) -> list[Action]:
        """An update (its envelope verified) with its blob: its bytes, or where to read
        them by range (a node's blob store)."""
        w = self._window
        update_id = signed.record_id
        if update_id in w.updates:
            return []
        verdict = belongs_to_window(self.experiment_id, w.base, signed.record, w.bases)
        if not verdict:
            self.late_update(now, signed)
            return []  # stale or replayed: belongs in no cohort, nothing to count
        return self._then_ballot(now, self._receive_update(now, signed, blob))

    def _receive_update(
        self, now: float, signed: Signed[Update], blob: bytes | bytearray | ByteSource
    ) -> list[Action]:
        w = self._window
        update_id = signed.record_id
        self.heard_from(signed.record.trainer, now)
        self._deadline(now)
        first = not w.arrival and not w.proposals
        w.updates[update_id] = Submission(signed.record, update_id, blob)
        w.arrival.append(update_id)
        # after the deadline an update still joins the cohort while nobody has proposed (a
        # window that had too few updates in time is not stuck for good)
        actions: list[Action] = []
        event = Event.FIRST_UPDATE if first else Event.UPDATE
        walk = Effect.WALK in self._fire(now, event, actions)
        if len(w.arrival) >= self.manifest.window.max_updates:
            walk |= Effect.WALK in self._fire(now, Event.FULL, actions)
        elif self._all_reported(now):
            walk |= Effect.WALK in self._fire(now, Event.REPORTED, actions)
        for proposer, missing in list(w.fetching.items()):
            if update_id in missing:
                w.fetching[proposer] = missing - {update_id}
                if not w.fetching[proposer]:
                    del w.fetching[proposer]
                    walk |= Effect.WALK in self._fire(now, Event.SETTLED, actions)
        return actions + self._advance(now) if walk else actions

    def receive_proposal(self, now: float, signed: Signed[Proposal]) -> list[Action]:
        return self._then_ballot(now, self._receive_proposal(now, signed))

    def _receive_proposal(self, now: float, signed: Signed[Proposal]) -> list[Action]:
        w = self._window
        proposal = signed.record
        if proposal.window != w.base.window or proposal.base_head != w.base.head_id:
            return []
        if proposal.reducer not in w.order:
            return [Reported(peer_id_of(proposal.reducer), "proposed without being a proposer")]
        if proposal.reducer in w.proposals:
            if w.proposals[proposal.reducer].record_id != signed.record_id:
                return [Reported(peer_id_of(proposal.reducer), "two proposals in one window")]
            return []
        self._deadline(now)
        w.proposals[proposal.reducer] = signed
        actions: list[Action] = []
        walk = Effect.WALK in self._fire(now, Event.PROPOSAL, actions)
        if len(proposal.accepted) + len(proposal.rejected) >= self.manifest.window.max_updates:
            walk |= Effect.WALK in self._fire(now, Event.FULL, actions)
        return actions + self._advance(now, walk=walk)

    def receive_attestation(self, now: float, signed: Signed[Attestation]) -> list[Action]:
        counted = self.book.add(signed)
        actions: list[Action] = []
        if counted.equivocation is not None:
            actions.append(Reported(counted.equivocation.validator_id, counted.verdict.reason))
        if counted.certificate is not None:
            certificate = counted.certificate
            # every head we computed or judged came with a proposal we hold
            head = next(
                (
                    p.record.head
                    for p in self._window.proposals.values()
                    if p.record.head.id == certificate.head_id
                ),
                None,
            )
            if head is not None:
                actions.append(SendCertificate(head, certificate))
                actions += self.receive_certificate(now, head, certificate, self.key)
            return actions
        return actions + self._ballot(now)

    def update_unavailable(self, now: float, update_id: str) -> list[Action]:
        """Nobody could deliver ``update_id`` (every try failed): a proposal that names it
        cannot be checked, so it is not attested (nobody is blamed: it may be our link)."""
        w = self._window
        stuck = [p for p, missing in w.fetching.items() if update_id in missing]
        for proposer in stuck:
            del w.fetching[proposer]
            w.judged[proposer] = Verdict(False, f"named update {update_id[:12]} nobody delivered")
            w.unchecked.add(proposer)  # judged again in the next voting round
            self.last_reason = f"proposal of {peer_id_of(proposer)[:12]}: cannot be checked"
        if not stuck:
            return []
        actions: list[Action] = []
        walk = Effect.WALK in self._fire(now, Event.SETTLED, actions)
        return self._then_ballot(now, actions + self._advance(now, walk=walk))

    def holds_update(self, update_id: str) -> bool:
        """Whether the open window took update ``update_id`` (it may be named and used)."""
        return update_id in self._window.updates

    def held_records(self) -> frozenset[str]:
        """The ids of the updates and proposals the open window took."""
        proposals = (p.record_id for p in self._window.proposals.values())
        return frozenset((*self._window.updates, *proposals))

    def holds_proposal(self, signed: Signed[Proposal]) -> bool:
        """Whether the open window took this proposal (it is judged, and may be asked for)."""
        held = self._window.proposals.get(signed.record.reducer)
        return held is not None and held.record_id == signed.record_id

    def reduction_of(self, head_id: str) -> Reduction | None:
        """Our own reduction that produced ``head_id`` in the open window, or the head just
        adopted (its blobs are what peers fetch from us once the head is certified)."""
        adopted = self._adopted_reduction
        if adopted is not None and adopted.head_id == head_id:
            return adopted
        return self._by_head.get(head_id)

    def tick(self, now: float) -> list[Action]:
        self._deadline(now)
        actions: list[Action] = []
        walk = False
        if self._all_reported(now):
            walk |= Effect.WALK in self._fire(now, Event.REPORTED, actions)
        walk |= Effect.WALK in self._fire(now, Event.TICK, actions)
        return self._then_ballot(now, actions + self._advance(now, walk=walk))

    def _deadline(self, now: float) -> None:
        """An open window whose deadline passed closes (or expires, holding nothing)."""
        w = self._window
        if w.phase is Phase.OPEN and self._slot(now) >= 0:
            empty = not w.arrival and not w.proposals
            self._fire(now, Event.EXPIRY if empty else Event.DEADLINE, [])

    # --- deciding ------------------------------------------------------------------------

    def _cohort(self) -> list[Submission]:
        w = self._window
        ids = w.arrival[: min(w.before_deadline, self.manifest.window.max_updates)]
        return [w.updates[i] for i in ids]

    def _reduce(self, cohort: Sequence[Submission]) -> Reduction:
        key = frozenset(s.update_id for s in cohort)
        reduction = self._reductions.get(key)
        if reduction is None:
            w = self._window
            timer = self._timer
            started = 0.0 if timer is None else timer()
            reduction = reduce_window(
                self.manifest, w.base, cohort, self.leases, w.bases, spool=self._spool
            )
            if timer is not None:
                self._timed(w.base.window, timer() - started, len(reduction.accepted))
            self._reductions[key] = reduction
            if reduction.head_id is not None:
                self.reductions += 1  # an outer step: the follower's once adopted
                self._by_head[reduction.head_id] = reduction
        return reduction

    def _timed(self, window: int, seconds: float, accepted: int) -> None:
        """Keep a reduction's wall seconds as the last one, and add them to the totals."""
        before = self._last_reduction
        count, total = (0, 0.0) if before is None else (before.count, before.total_seconds)
        self._last_reduction = ReductionTiming(
            window=window,
            seconds=seconds,
            accepted=accepted,
            count=count + 1,
            total_seconds=total + seconds,
        )

    def _advance(self, now: float, *, walk: bool = True) -> list[Action]:
        """The clock's events (the close, a sync slot, slots past the order), then the walk
        if an event asked for it."""
        self._deadline(now)
        w = self._window
        actions: list[Action] = []
        slot = self._slot(now)
        if slot > w.slot and w.order:
            w.slot = slot
            if slot >= 1 and (slot - 1) % SYNC_EVERY_SLOTS == 0:
                self._fire(now, Event.SYNC_DUE, actions)
            if slot >= len(w.order):
                self._fire(now, Event.ORDER_OVER, actions)
        if walk and slot >= 0 and w.order:
            self._walk(now, slot, actions)
        return actions

    def _walk(self, now: float, slot: int, actions: list[Action]) -> None:
        """Each proposer whose slot opened, in slot order, until a row says STOP (a wrong
        proposal opens the next slot at once: SKIP)."""
        w = self._window
        limit = min(slot, len(w.order) - 1)  # the last proposer whose slot has opened
        index = -1
        while index < limit and w.phase in WALKING:
            index += 1
            proposer = w.order[index]
            event, head_id = self._look_at(proposer, actions)
            effects = self._fire(now, event, actions, head_id)
            if Effect.PROPOSE in effects:
                event, head_id = self._propose_own(actions)
                effects = self._fire(now, event, actions, head_id)
            if Effect.STOP in effects:
                break
            if Effect.SKIP in effects:
                limit = min(max(limit, index + 1), len(w.order) - 1)

    def _look_at(self, proposer: bytes, actions: list[Action]) -> tuple[Event, str | None]:
        """What the walk finds at ``proposer``'s slot (with the head of a valid proposal)."""
        w = self._window
        if proposer == self.key:
            return Event.OWN_SLOT, None
        verdict = self._judge(proposer, actions)
        if verdict is None:
            # its updates on their way: judge it before proposing or judging a later one
            # (skipping ahead splits the validators' votes for good)
            return (Event.AWAITING if proposer in w.fetching else Event.ABSENT), None
        if not verdict.ok:
            return Event.WRONG, None
        return Event.VALID, w.proposals[proposer].record.head.id

    def _judge(self, proposer: bytes, actions: list[Action]) -> Verdict | None:
        """The verdict on ``proposer``'s proposal, None while absent or fetching."""
        w = self._window
        if proposer in w.judged:
            return w.judged[proposer]
        signed = w.proposals.get(proposer)
        if signed is None or proposer in w.fetching:
            return None
        proposal = signed.record
        named = [*proposal.accepted, *(r.update_id for r in proposal.rejected)]
        if len(named) > self.manifest.window.max_updates:
            verdict = Verdict(False, "proposal names more updates than window.max_updates")
        else:
            missing = frozenset(i for i in named if i not in w.updates)
            if missing:
                w.fetching[proposer] = missing
                actions.append(FetchUpdates(proposer, tuple(sorted(missing))))
                return None
            verdict = self._compare(proposal, [w.updates[i] for i in named])
        w.judged[proposer] = verdict
        self.judged_count += 1
        self.last_reason = f"proposal of {peer_id_of(proposer)[:12]}: {verdict.reason}"
        if not verdict.ok:
            self.wrong_count += 1
            if proposer in self.reducers:
                self.dropped.add(proposer)
            actions.append(Reported(peer_id_of(proposer), verdict.reason))
        return verdict

    def _compare(self, proposal: Proposal, cohort: list[Submission]) -> Verdict:
        reduction = self._reduce(cohort)
        if reduction.head is None:
            return Verdict(False, f"the proposal's cohort yields no head: {reduction.reason}")
        if reduction.accepted != proposal.accepted:
            return Verdict(False, "accepted updates differ from our recomputation")
        if reduction.rejected != proposal.rejected:
            return Verdict(False, "rejected updates or reasons differ from our recomputation")
        if reduction.head.aggregate_blob != proposal.aggregate_blob:
            return Verdict(False, "aggregate differs from our recomputation")
        if reduction.head_id != proposal.head.id:
            return Verdict(False, "head (weights or quarantine) differs from our recomputation")
        return Verdict(True, f"recomputed the same head {reduction.head_id[:12]}")

    def _propose_own(self, actions: list[Action]) -> tuple[Event, str | None]:
        w = self._window
        reduction = self._reduce(self._cohort())
        if reduction.head is None or reduction.head.aggregate_blob is None:
            # not proposed: tried again as late updates arrive (the reduction of an
            # unchanged cohort is cached)
            self.last_reason = f"no proposal: {reduction.reason}{_refusals(reduction)}"
            return Event.NO_HEAD, None
        proposal = Proposal(
            experiment_id=self.experiment_id,
            window=w.base.window,
            base_head=w.base.head_id,
            reducer=self.key,
            accepted=reduction.accepted,
            rejected=reduction.rejected,
            aggregate_blob=reduction.head.aggregate_blob,
            head=reduction.head,
        )
        signed = seal(self.identity, proposal)
        w.proposals[self.key] = signed
        w.judged[self.key] = Verdict(True, "our own reduction")
        self.last_reason = f"proposed {reduction.head_id} ({reduction.reason})"
        actions.append(SendProposal(signed))
        return Event.PROPOSED, reduction.head_id

    def _attestation(
        self, height: int, head_id: str, round_: int, stage: str
    ) -> Signed[Attestation]:
        record = Attestation(
            experiment_id=self.experiment_id,
            height=height,
            head_id=head_id,
            validator=self.key,
            round=round_,
            stage=stage,
        )
        return seal(self.identity, record)

    # --- voting rounds (see :mod:`.ballot`) -----------------------------------------------

    def _vote(self, now: float, height: int, head_id: str) -> list[Action]:
        """The walk chose ``head_id``: our first prevote at this height (our lock instead,
        if a restart kept one)."""
        ballot = self.votes.get(height)
        if ballot is None:
            ballot = self.votes[height] = Ballot(round=self._round_due(now, height))
        if ballot.prevote is not None:
            return []
        actions: list[Action] = []
        choice = head_id if ballot.lock is None else self._choice(ballot, actions)
        if choice is None:
            return actions
        return actions + self._cast(now, ballot, "prevote", choice)

    def _then_ballot(self, now: float, actions: list[Action]) -> list[Action]:
        """``actions``, then what our ballot does after the input that made them."""
        return actions + self._ballot(now)

    def _ballot(self, now: float) -> list[Action]:
        """A validator that voted at this height: into the round due (prevoting again), a
        prevote it still owes, a commit once q prevoted one head in its round."""
        w = self._window
        height = w.base.window
        ballot = self.votes.get(height)
        if self.role is not Role.VALIDATOR or ballot is None or w.phase is not Phase.ATTESTED:
            return []
        actions: list[Action] = []
        if ballot.enter(self._round_due(now, height)):
            for proposer in w.unchecked:  # judged again: its updates may arrive now
                w.judged.pop(proposer, None)
            w.unchecked.clear()
            self.last_reason = f"window {height}: voting round {ballot.round}, no certificate yet"
        if ballot.prevote is None:
            choice = self._choice(ballot, actions)
            if choice is not None:
                actions += self._cast(now, ballot, "prevote", choice)
                if self._window is not w:  # the cast certified the height: the next window
                    return actions
        head = self.book.polka(height, ballot.round)
        if ballot.commit is None and head is not None and self._checked(head, actions):
            if ballot.prevote is None:
                actions += self._cast(now, ballot, "prevote", head)
            if self._window is w and ballot.commit is None:
                ballot.lock, ballot.lock_round = head, ballot.round
                actions += self._cast(now, ballot, "commit", head)
        return actions

    def _round_due(self, now: float, height: int) -> int:
        """The round our clock says (a pass of the proposers' slots each), or a later one
        that more than ``n - q`` validators voted in."""
        w = self._window
        slot = self._slot(now)
        timed = slot // len(w.order) if slot >= 0 and w.order else 0
        joined = len(self.manifest.validators) - self.manifest.quorum + 1
        return max(timed, self.book.round_reached(height, joined))

    def _choice(self, ballot: Ballot, actions: list[Action]) -> str | None:
        """What we prevote in ``ballot``'s round: the lock, unless q validators prevoted
        another head in a round after it; unlocked, the head of the latest round where q
        validators prevoted one (what locked validators hold), else the earliest valid
        proposal held (None: nothing to prevote yet)."""
        polkas = self.book.polkas(self._window.base.window)
        lock = ballot.lock
        if lock is not None:
            later = [r for r in polkas if ballot.lock_round < r <= ballot.round]
            unlocked = polkas[max(later)] if later else lock
            return unlocked if unlocked == lock or self._checked(unlocked, actions) else lock
        agreed = polkas[max(polkas)] if polkas else None
        if agreed is not None and self._checked(agreed, actions):
            return agreed
        return self._earliest_valid(actions)

    def _earliest_valid(self, actions: list[Action]) -> str | None:
        """The head of the first proposal in slot order that we recomputed (None: none, or
        an earlier one's updates are still on their way)."""
        w = self._window
        for proposer in w.order:
            if proposer not in w.proposals:
                continue
            verdict = self._judge(proposer, actions)
            if verdict is None:
                return None
            if verdict.ok:
                return w.proposals[proposer].record.head.id
        return None

    def _checked(self, head_id: str, actions: list[Action]) -> bool:
        """Whether we recomputed ``head_id`` (judging the proposal that holds it if need be;
        False while its updates are on their way)."""
        if head_id in self._by_head:
            return True
        w = self._window
        for proposer, signed in list(w.proposals.items()):
            if signed.record.head.id == head_id:
                verdict = self._judge(proposer, actions)
                return verdict is not None and verdict.ok
        return False

    def _cast(self, now: float, ballot: Ballot, stage: str, head_id: str) -> list[Action]:
        """Sign and send our ``stage`` vote for ``head_id`` in the ballot's round (stored
        first: the action carries the ballot), and count it ourselves."""
        height = self._window.base.window
        if stage == "prevote":
            ballot.prevote = head_id
        else:
            ballot.commit = head_id
        signed = self._attestation(height, head_id, ballot.round, stage)
        stored = dataclasses.replace(ballot)
        return [SendAttestation(signed, ballot=stored), *self.receive_attestation(now, signed)]

    def _resend(self, height: int) -> list[Action]:
        """Our votes of the current round, sent again (lost messages); locked, also the q
        prevotes that locked us (a validator that missed them follows the lock)."""
        ballot = self.votes.get(height)
        if ballot is None:
            return []
        ours: list[Action] = [
            SendAttestation(self._attestation(height, head, ballot.round, stage), again=True)
            for stage, head in (("prevote", ballot.prevote), ("commit", ballot.commit))
            if head is not None
        ]
        if ballot.lock is None or ballot.lock_round == ballot.round:
            return ours
        polka = self.book.polka_votes(height, ballot.lock_round)
        return ours + [SendAttestation(signed, again=True) for signed in polka]

    def statistics(self) -> ParticipantStatistics:
        w = self._window
        ballot = self.votes.get(w.base.window)
        return ParticipantStatistics(
            **self._chain_statistics(),
            window=w.base.window,
            reductions=self.reductions,
            updates=len(w.updates),
            proposals_judged=self.judged_count,
            proposals_wrong=self.wrong_count,
            attested=None if ballot is None else ballot.head,
            dropped_reducers=len(self.dropped),
            equivocations=len(self.book.equivocations),
        )


def _refusals(reduction: Reduction, shown: int = 3) -> str:
    """The first rejection reasons of a reduction that made no head, for the status."""
    if not reduction.rejected:
        return ""
    listed = "; ".join(f"{r.update_id[:12]}: {r.describe()}" for r in reduction.rejected[:shown])
    more = len(reduction.rejected) - shown
    return f" (rejected {listed}{f'; {more} more' if more > 0 else ''})"
