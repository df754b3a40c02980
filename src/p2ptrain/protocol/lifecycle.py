"""The life of a participant's window, as one table (DESIGN §4 steps 4-7).

Every change of a window's phase is a row of :data:`TRANSITIONS`: (phase, event) goes to a
phase with effects, per role. A reducer and a validator run the same code
(:class:`~p2ptrain.protocol.participant.Participant`) and differ only by their rows: a
reducer's own proposal ends its window's work, a validator's is followed by its vote; a
reducer stops at the first valid proposal it judges, a validator attests it. A pair not in
the table changes nothing (a proposal that arrives for an attested window, an update after a
reducer proposed: held, and answered to peers who ask, but they change nothing here).

The window's close is defined here once: it is full (``FULL``), every expected trainer
reported (``REPORTED``) or the deadline passed (``DEADLINE``). The deadline runs from the
window's first update (``FIRST_UPDATE``: ``START``), not from when the window opened here: a
slow start, a slow download or a late joiner costs the trainers nothing, since nobody's
clock runs before the first trainer is done. A window that holds nothing ``deadline_s`` after
it opened expires (``EXPIRY``: it asks its peers what they hold), and its first update starts
the deadline the same way. After the close the proposers' slots open
one after the other (:mod:`.proposers`), and each tick walks them (``WALK``): for each
proposer whose slot opened, in slot order, the participant classifies what it holds
(``OWN_SLOT``, ``ABSENT``, ``AWAITING``, ``WRONG``, ``VALID``) and takes that event's row;
``STOP`` ends the walk, ``SKIP`` opens the next proposer's slot at once.

The participant turns its inputs (an update, a proposal, the clock, a fetch that settled) into
these events; effects are what it then does. ``docs/protocol.md`` prints the table
(:mod:`.spec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "EFFECTS",
    "EVENTS",
    "PHASES",
    "TRANSITIONS",
    "WALKING",
    "Effect",
    "Event",
    "Phase",
    "Role",
    "Transition",
    "transition",
]


class Role(StrEnum):
    REDUCER = "reducer"
    VALIDATOR = "validator"


class Phase(StrEnum):
    OPEN = "open"
    EXPIRED = "expired"
    CLOSED = "closed"
    PROPOSED = "proposed"
    ATTESTED = "attested"
    CERTIFIED = "certified"


class Event(StrEnum):
    FIRST_UPDATE = "first_update"
    UPDATE = "update"
    FULL = "full"
    REPORTED = "reported"
    DEADLINE = "deadline"
    EXPIRY = "expiry"
    PROPOSAL = "proposal"
    TICK = "tick"
    SYNC_DUE = "sync_due"
    ORDER_OVER = "order_over"
    SETTLED = "settled"
    OWN_SLOT = "own_slot"
    ABSENT = "absent"
    AWAITING = "awaiting"
    WRONG = "wrong"
    VALID = "valid"
    PROPOSED = "proposed"
    NO_HEAD = "no_head"
    VOTED = "voted"
    ADOPTED = "adopted"


class Effect(StrEnum):
    JOIN = "join"
    JOIN_UNPROPOSED = "join_unproposed"
    CLOSE = "close"
    START = "start"
    WALK = "walk"
    SYNC = "sync"
    RESEND = "resend"
    PROPOSE = "propose"
    PREPARE = "prepare"
    VOTE = "vote"
    SKIP = "skip"
    STOP = "stop"
    NEXT = "next"


#: What each phase means.
PHASES: dict[Phase, str] = {
    Phase.OPEN: "collecting the window's updates, until the deadline (`deadline_s` after the "
    "first update) or an early close",
    Phase.EXPIRED: "`deadline_s` passed since the window opened, holding no update and no proposal",
    Phase.CLOSED: "closed: the proposers' slots open one after the other, proposals are judged "
    "in slot order and ours is made in our slot",
    Phase.PROPOSED: "a reducer proposed its head: it waits for the certificate (and still "
    "judges the slots before its own)",
    Phase.ATTESTED: "a validator voted at this height: it votes on, round after round "
    "(`ballot.py`), until a head is certified",
    Phase.CERTIFIED: "a certified head at this height was adopted: the next window opens",
}

#: What each event is.
EVENTS: dict[Event, str] = {
    Event.FIRST_UPDATE: "the window's first update arrived (it held no update and no proposal)",
    Event.UPDATE: "another update of the window arrived (its envelope verified, built on an "
    "allowed base)",
    Event.FULL: "the window holds `max_updates` updates, or a proposal names that many",
    Event.REPORTED: "it holds `min_updates` and every expected trainer reported",
    Event.DEADLINE: "the deadline passed holding an update or a proposal",
    Event.EXPIRY: "`deadline_s` since the window opened passed holding nothing",
    Event.PROPOSAL: "a proposal for the window arrived from one of its proposers",
    Event.TICK: "the clock ticked: at a slot boundary, when an expected trainer lapsed, or "
    "after an input",
    Event.SYNC_DUE: "a sync slot opened: slot 1, then every `SYNC_EVERY_SLOTS`",
    Event.ORDER_OVER: "a slot past the last proposer's opened (the order starts over)",
    Event.SETTLED: "the updates a proposal named arrived, or one of them nobody delivered",
    Event.OWN_SLOT: "walk: our own slot",
    Event.ABSENT: "walk: no proposal from this proposer yet",
    Event.AWAITING: "walk: its proposal names updates on their way to us",
    Event.WRONG: "walk: its proposal is wrong (we recomputed another result, or cannot check it)",
    Event.VALID: "walk: its proposal is what we recomputed",
    Event.PROPOSED: "our reduction made a head and we proposed it",
    Event.NO_HEAD: "our reduction made no head (too few updates passed)",
    Event.VOTED: "we voted at this height before (a restart after the vote)",
    Event.ADOPTED: "the node adopted a certified head at this height",
}

#: What each effect does.
EFFECTS: dict[Effect, str] = {
    Effect.JOIN: "the update joins the cohort (it counts as before the deadline)",
    Effect.JOIN_UNPROPOSED: "the update joins the cohort while no proposal is held",
    Effect.CLOSE: "the deadline is now: slot 0 opens",
    Effect.START: "the deadline is `deadline_s` from now (the slots, if any opened, start over)",
    Effect.WALK: "walk the proposers whose slot opened, in slot order (once per input)",
    Effect.SYNC: "ask peers what the window holds (`SyncWindow`)",
    Effect.RESEND: "send our votes of the round again",
    Effect.PROPOSE: "reduce our cohort and propose its head (then `proposed` or `no_head`)",
    Effect.PREPARE: "reduce our own cohort ahead of its proposal (kept by cohort: judging a "
    "proposal that names the same updates takes no time); nothing is sent",
    Effect.VOTE: "prevote the head (our first vote at this height)",
    Effect.SKIP: "the next proposer's slot counts as open",
    Effect.STOP: "the walk ends here",
    Effect.NEXT: "the next window opens on the adopted head",
}


@dataclass(frozen=True, slots=True)
class Transition:
    phase: Phase
    effects: tuple[Effect, ...] = ()


def _to(phase: Phase, *effects: Effect) -> Transition:
    return Transition(phase, effects)


_P, _E, _X = Phase, Event, Effect

#: The rows both roles take.
_SHARED: dict[tuple[Phase, Event], Transition] = {
    (_P.OPEN, _E.FIRST_UPDATE): _to(_P.OPEN, _X.START, _X.JOIN),
    (_P.OPEN, _E.UPDATE): _to(_P.OPEN, _X.JOIN),
    (_P.OPEN, _E.FULL): _to(_P.CLOSED, _X.CLOSE, _X.WALK),
    (_P.OPEN, _E.REPORTED): _to(_P.CLOSED, _X.CLOSE, _X.WALK),
    (_P.OPEN, _E.DEADLINE): _to(_P.CLOSED),
    (_P.OPEN, _E.EXPIRY): _to(_P.EXPIRED),
    (_P.OPEN, _E.PROPOSAL): _to(_P.OPEN),
    (_P.EXPIRED, _E.FIRST_UPDATE): _to(_P.OPEN, _X.START, _X.JOIN),
    (_P.EXPIRED, _E.PROPOSAL): _to(_P.CLOSED, _X.WALK),
    (_P.EXPIRED, _E.SYNC_DUE): _to(_P.EXPIRED, _X.SYNC),
    (_P.CLOSED, _E.UPDATE): _to(_P.CLOSED, _X.JOIN_UNPROPOSED),
    (_P.CLOSED, _E.PROPOSAL): _to(_P.CLOSED, _X.WALK),
    (_P.CLOSED, _E.TICK): _to(_P.CLOSED, _X.WALK),
    (_P.CLOSED, _E.SYNC_DUE): _to(_P.CLOSED, _X.SYNC),
    (_P.CLOSED, _E.SETTLED): _to(_P.CLOSED, _X.WALK),
    (_P.CLOSED, _E.OWN_SLOT): _to(_P.CLOSED, _X.PROPOSE),
    (_P.CLOSED, _E.ABSENT): _to(_P.CLOSED),
    (_P.CLOSED, _E.AWAITING): _to(_P.CLOSED, _X.STOP),
    (_P.CLOSED, _E.WRONG): _to(_P.CLOSED, _X.SKIP),
}

_REDUCER: dict[tuple[Phase, Event], Transition] = {
    (_P.CLOSED, _E.PROPOSED): _to(_P.PROPOSED, _X.STOP),
    (_P.CLOSED, _E.NO_HEAD): _to(_P.CLOSED, _X.STOP),
    (_P.CLOSED, _E.VALID): _to(_P.CLOSED, _X.STOP),
    (_P.PROPOSED, _E.PROPOSAL): _to(_P.PROPOSED, _X.WALK),
    (_P.PROPOSED, _E.TICK): _to(_P.PROPOSED, _X.WALK),
    (_P.PROPOSED, _E.SETTLED): _to(_P.PROPOSED, _X.WALK),
    (_P.PROPOSED, _E.OWN_SLOT): _to(_P.PROPOSED, _X.STOP),
    (_P.PROPOSED, _E.ABSENT): _to(_P.PROPOSED),
    (_P.PROPOSED, _E.AWAITING): _to(_P.PROPOSED, _X.STOP),
    (_P.PROPOSED, _E.WRONG): _to(_P.PROPOSED, _X.SKIP),
    (_P.PROPOSED, _E.VALID): _to(_P.PROPOSED, _X.STOP),
}

_VALIDATOR: dict[tuple[Phase, Event], Transition] = {
    (_P.OPEN, _E.VOTED): _to(_P.ATTESTED),
    (_P.CLOSED, _E.ABSENT): _to(_P.CLOSED, _X.PREPARE),
    (_P.CLOSED, _E.PROPOSED): _to(_P.ATTESTED, _X.VOTE),
    (_P.CLOSED, _E.NO_HEAD): _to(_P.CLOSED),
    (_P.CLOSED, _E.VALID): _to(_P.ATTESTED, _X.VOTE),
    (_P.ATTESTED, _E.ORDER_OVER): _to(_P.ATTESTED, _X.RESEND),
    (_P.ATTESTED, _E.SYNC_DUE): _to(_P.ATTESTED, _X.SYNC),
}

#: The phases in which the slots are walked (a reducer that proposed still judges the slots
#: before its own; an attested window is done).
WALKING = frozenset({Phase.CLOSED, Phase.PROPOSED})


def _adoptions() -> dict[tuple[Phase, Event], Transition]:
    return {
        (phase, Event.ADOPTED): _to(Phase.CERTIFIED, Effect.NEXT)
        for phase in Phase
        if phase is not Phase.CERTIFIED
    }


#: role -> (phase, event) -> the phase it goes to and the effects, in order.
TRANSITIONS: dict[Role, dict[tuple[Phase, Event], Transition]] = {
    Role.REDUCER: {**_SHARED, **_REDUCER, **_adoptions()},
    Role.VALIDATOR: {**_SHARED, **_VALIDATOR, **_adoptions()},
}


def transition(role: Role, phase: Phase, event: Event) -> Transition:
    """Where ``event`` takes a ``role``'s window in ``phase`` (unchanged, without effects, for
    a pair the table does not name)."""
    return TRANSITIONS[role].get((phase, event), Transition(phase))
