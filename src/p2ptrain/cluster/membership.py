"""Who is in the cluster, who leads it, and when it forms again: pure rules, no I/O.

**Seniority.** A member's ``since`` is the first generation it trained in (None before it
has trained). The most senior member is the one with the lowest ``since``; members that
have not trained yet come after every member that has; ties go to the lowest peer id. The
leader of a generation is the most senior of the members alive when it forms: it hosts the
generation's store, takes rank 0 and decides who is in the next generation. Seniority never
changes while a member lives, so when the leader dies every survivor elects the same next
leader from what it knows, without a vote.

**Forming.** The leader forms a generation from the members that asked it to join
(:func:`decide_forming`): once every member it knows to be alive has asked, or once it has
waited ``settle_s`` for the others; the first generation also waits until ``wait_for``
members are there and the LAN has been searched for ``discovery_s``. Each rank's place is
its seniority (the leader first); the state everyone starts from is that of the member with
the highest completed step, the leader on a tie (:func:`plan_generation`).

**Re-forming.** A generation ends at a step boundary when the member set changes
(:func:`decide_reform`: someone waits to join, or a member is leaving), or when a collective
fails (a member died), after which every survivor forms the next one.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

__all__ = [
    "GenerationPlan",
    "Member",
    "decide_forming",
    "decide_reform",
    "decide_refused",
    "elect",
    "lost_members",
    "next_generation",
    "plan_generation",
    "seniority",
]


@dataclass(frozen=True, slots=True)
class Member:
    """What a member says of itself (proven by its peer id's key and the secret)."""

    peer_id: str
    #: Where its control endpoint answers: ``HOST:PORT``.
    address: str
    #: The first generation it trained in; None before it has trained.
    since: int | None
    #: Steps its weights and optimizer state have completed.
    completed_step: int
    #: The last generation it belonged to; -1 before any.
    generation: int


class GenerationPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One generation as its leader formed it: who holds which rank, where the store is,
    and whose state everyone starts from."""

    number: int
    leader: str
    #: Peer ids by rank (the leader is rank 0).
    members: tuple[str, ...]
    #: Each rank's ``since`` (its first generation; this one for a newcomer).
    since: tuple[int, ...]
    #: The rank whose weights, optimizer state and step everyone starts from.
    source_rank: int
    start_step: int
    #: The leader's TCPStore for this generation (set once the leader has opened it).
    store_host: str = ""
    store_port: int = 0

    @property
    def world(self) -> int:
        return len(self.members)

    def rank_of(self, peer_id: str) -> int | None:
        return self.members.index(peer_id) if peer_id in self.members else None


def seniority(member: Member) -> tuple[bool, int, str]:
    """Sort key: the most senior member sorts first."""
    return (member.since is None, member.since or 0, member.peer_id)


def elect(members: Iterable[Member]) -> Member:
    """The leader: the most senior of ``members`` (which must not be empty)."""
    ranked = sorted(members, key=seniority)
    if not ranked:
        raise ValueError("a leader is elected from at least one member")
    return ranked[0]


def next_generation(members: Iterable[Member]) -> int:
    """The number of the next generation: one past the last any of ``members`` was in."""
    return max((m.generation for m in members), default=-1) + 1


def plan_generation(number: int, leader: Member, others: Iterable[Member]) -> GenerationPlan:
    """The generation ``number`` of ``leader`` and ``others`` (duplicates of the leader
    ignored): ranks by seniority with the leader at 0, the source the highest completed
    step (the leader on a tie, then seniority)."""
    rest = sorted({m.peer_id: m for m in others if m.peer_id != leader.peer_id}.values(),
                  key=seniority)  # fmt: skip
    ranked = [leader, *rest]
    source = max(
        range(len(ranked)),
        key=lambda rank: (ranked[rank].completed_step, rank == 0, -rank),
    )
    return GenerationPlan(
        number=number,
        leader=leader.peer_id,
        members=tuple(m.peer_id for m in ranked),
        since=tuple(number if m.since is None else m.since for m in ranked),
        source_rank=source,
        start_step=ranked[source].completed_step,
    )


def decide_forming(
    now: float,
    *,
    forming_since: float,
    not_before: float,
    settle_s: float,
    alive: Collection[str],
    asked: Collection[str],
    wait_for: int,
    first: bool,
) -> tuple[bool, str]:
    """Whether the leader forms a generation now, of itself and the members in ``asked``
    (those in ``alive`` answered its last probe), and why (or why not yet)."""
    present = len(asked) + 1
    if first and now < not_before:
        return False, f"searching the LAN for members ({present} so far)"
    if first and present < wait_for:
        return False, f"waiting for members: {present} of --wait-for {wait_for} are ready"
    missing = set(alive) - set(asked)
    if not missing:
        return True, f"every member alive is ready ({present})"
    if now - forming_since >= settle_s:
        return True, (
            f"forming with the {present} ready; {len(missing)} alive did not ask within "
            f"{settle_s:g} s (they join at the next re-form)"
        )
    return False, f"waiting up to {settle_s:g} s for {len(missing)} more member(s) to ask"


def decide_reform(
    members: Collection[str], waiting: Iterable[str], *, leaving: bool
) -> tuple[bool, str]:
    """Whether a generation of ``members`` ends at the next step boundary, and why:
    members outside it are ``waiting`` to join, or this member is leaving."""
    if leaving:
        return True, "this member is leaving"
    joiners = sorted(set(waiting) - set(members))
    if joiners:
        return (
            True,
            f"{len(joiners)} member(s) waiting to join: {', '.join(p[:12] for p in joiners)}",
        )
    return False, "the member set is unchanged"


def decide_refused(
    now: float,
    *,
    not_before: float,
    trained: bool,
    proven: int,
    differing: Mapping[str, str],
) -> str | None:
    """Why this member gives up (None: it goes on): it has searched the LAN, has never
    trained, proved the secret to no member, and some members (``differing``: address ->
    reason) hold another secret or train something else."""
    if trained or proven or not differing or now < not_before:
        return None
    addresses = ", ".join(sorted(differing))
    return f"refused by the members at {addresses}: {next(iter(sorted(differing.values())))}"


def lost_members(previous: Sequence[str], alive: Collection[str], *, me: str) -> list[str]:
    """The members of the previous generation, other than ``me``, that are not ``alive``."""
    return [peer for peer in previous if peer != me and peer not in alive]
