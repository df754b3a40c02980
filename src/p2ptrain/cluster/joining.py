"""Joining a generation: a follower asking its leader, and the desk where a leader keeps
the requests until it forms the generation.

A join request is long-polled: the member asked holds it for up to :data:`POLL_S`, and
answers as soon as something changes (it formed a generation with the asker in it:
``Formed``; it does not lead and will not soon: ``NotLeader``), else ``Wait``. The asker
asks again at once, so the desk knows who is still asking: it keeps each asker's latest
request for :data:`REQUEST_TTL_S`, and a leader forms from those (and, while it trains,
votes to end the generation when one of them is not in it). A follower asks one leader for
:data:`FOLLOW_S` at most before it probes again (the leader may be gone, or another may lead).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from p2ptrain.cluster.membership import GenerationPlan
from p2ptrain.cluster.rendezvous import SecretDiffers
from p2ptrain.cluster.roster import PROBE_TIMEOUT_S, Roster
from p2ptrain.cluster.wire import Formed, Incompatible, JoinRequest, MemberInfo, NotLeader, Reply
from p2ptrain.cluster.wire import Wait as WaitReply
from p2ptrain.errors import ProtocolViolation, TransportError

__all__ = ["FOLLOW_S", "POLL_S", "REQUEST_TTL_S", "JoinDesk", "ask_to_join"]

log = logging.getLogger(__name__)

POLL_S = 1.0  # how long a member holds a join request before answering
FOLLOW_S = 3.0  # how long a follower asks one leader before probing again
REQUEST_TTL_S = POLL_S + PROBE_TIMEOUT_S + 1.0  # a join request counts this long


class JoinDesk:
    """The join requests a member holds, the plan it formed (or trains), and a signal that
    wakes whoever waits for either to change."""

    def __init__(self, me: str, clock: Callable[[], float]) -> None:
        self.me, self._clock = me, clock
        #: The generation this member formed as leader, or trains in (None between them).
        self.plan: GenerationPlan | None = None
        self._requests: dict[str, tuple[float, MemberInfo]] = {}
        self._changed = asyncio.Event()

    @property
    def changed(self) -> asyncio.Event:
        """Set at the next :meth:`notify`: take it before looking, then wait on it."""
        return self._changed

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, event: asyncio.Event, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(0.0, timeout_s))

    def asked(self) -> dict[str, MemberInfo]:
        """The members still asking to join (and ready to train), by peer id."""
        now = self._clock()
        self._requests = {p: r for p, r in self._requests.items() if now - r[0] <= REQUEST_TTL_S}
        return {p: info for p, (_, info) in self._requests.items() if info.ready}

    def formed(self, plan: GenerationPlan) -> None:
        """This member formed ``plan``: its members' requests are answered with it."""
        for peer in plan.members:
            self._requests.pop(peer, None)
        self.plan = plan
        self.notify()

    async def answer(
        self,
        peer: str,
        info: MemberInfo,
        *,
        leading: Callable[[], bool],
        settled: Callable[[], bool],
        leader_address: Callable[[], str | None],
        on_request: Callable[[], None],
    ) -> Reply:
        """The answer to ``peer``'s join request, within :data:`POLL_S`. ``leading()``:
        this member leads now; ``settled()``: it will not lead soon (it trains, or leaves)."""
        deadline = self._clock() + POLL_S
        while True:
            changed, plan = self._changed, self.plan
            if plan is not None and plan.leader == self.me and info.generation < plan.number:
                rank = plan.rank_of(peer)
                if rank is not None:
                    return Formed(plan=plan, rank=rank)
            late = self._clock() >= deadline
            if not leading():
                if late or settled():
                    return NotLeader(
                        leader=leader_address(), reason="this member does not lead the cluster"
                    )
            else:
                self._requests[peer] = (self._clock(), info)
                on_request()
                self.notify()
                if late:
                    return WaitReply(reason="the leader is forming the next generation")
            await self.wait(changed, deadline - self._clock())


async def ask_to_join(
    address: str,
    leader: str,
    *,
    me: Callable[[], MemberInfo],
    roster: Roster,
    leaving: Callable[[], bool],
    clock: Callable[[], float],
) -> GenerationPlan | None:
    """Ask ``leader`` (at ``address``) to join until it answers with a plan that holds us
    (returned), for :data:`FOLLOW_S` at most; None when it does not lead, is gone, refuses
    us, or kept us waiting (the caller probes and elects again)."""
    until = clock() + FOLLOW_S
    while not leaving() and clock() < until:
        request = JoinRequest(member=me(), known=roster.known())
        try:
            peer, reply = await roster.ask(address, request, POLL_S + PROBE_TIMEOUT_S)
        except SecretDiffers as exc:
            roster.differ(address, str(exc))
            return None
        except (TransportError, ProtocolViolation) as exc:
            log.info("cluster: leader %s did not answer: %s", leader[:12], exc)
            roster.drop(leader)
            return None
        if peer != leader:
            return None
        if isinstance(reply, Formed):
            plan = reply.plan
            ours = plan.leader == leader and plan.rank_of(roster.me) == reply.rank
            return plan if ours else None
        if isinstance(reply, NotLeader) and reply.leader is not None:
            roster.learn(reply.leader)
        if isinstance(reply, Incompatible):
            roster.differ(address, reply.reason)
        if not isinstance(reply, WaitReply):
            return None
    return None
