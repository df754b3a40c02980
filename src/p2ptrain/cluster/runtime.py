"""A cluster member: discovery, election and rendezvous on asyncio, training on a thread.

The member serves its control endpoint (:mod:`.rendezvous`), announces it on mDNS (the
``net.mdns`` discovery, under a network id derived from the cluster's name) and builds its
workload on the training thread meanwhile. Then, over and over:

1. **Probe** every member it knows (mDNS, ``--peer``, and what members tell each other):
   the ones that prove the secret and train the same thing are alive; the others are refused.
2. **Elect** the most senior of them and itself (:func:`.membership.elect`).
3. **Rendezvous**: a leader collects join requests until :func:`.membership.decide_forming`
   says form, opens the generation's store and answers each requester with the plan; a
   follower asks its leader to join until it gets the plan (or learns of another leader, or
   finds the leader gone, and goes back to 1).
4. **Train** the generation on the training thread (:mod:`.training`) until it is voted
   to an end (a member waits to join: the leader votes; this member leaves), it fails (a
   member died: the collectives time out or break), or the steps are done.

A member that searched the LAN, never trained, and proved the secret to nobody while some
refused it gives up with :class:`ClusterRefused` (:func:`.membership.decide_refused`).
Every network wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from p2ptrain.cluster import events
from p2ptrain.cluster.interfaces import lan_address
from p2ptrain.cluster.joining import JoinDesk, ask_to_join
from p2ptrain.cluster.membership import (
    GenerationPlan,
    Member,
    decide_forming,
    decide_reform,
    decide_refused,
    elect,
    lost_members,
    next_generation,
    plan_generation,
    seniority,
)
from p2ptrain.cluster.rendezvous import ControlEndpoint, ask, open_generation_store
from p2ptrain.cluster.roster import Roster
from p2ptrain.cluster.settings import ClusterSettings
from p2ptrain.cluster.threads import start_in_thread
from p2ptrain.cluster.wire import (
    Incompatible,
    MemberInfo,
    Reply,
    Request,
    StatusReply,
    StatusRequest,
)
from p2ptrain.core.identity import Identity
from p2ptrain.errors import LocalError
from p2ptrain.net.mdns import LanDiscovery, LanPeer

if TYPE_CHECKING:  # torch: imported by the training thread, while the member meets others
    from p2ptrain.cluster.training import Outcome, StepReport

__all__ = ["ClusterMember", "ClusterRefused", "Generations"]

log = logging.getLogger(__name__)

ROUND_S = 0.25  # the leader's forming loop looks again at least this often
WATCH_S = 2.0  # how often a training member probes the others


#: How long a member that gives up early waits for its model build to finish.
_BUILD_WAIT_S = 300.0


async def _built(build: asyncio.Future[Generations]) -> None:
    """Let the build thread finish before the member returns: a member refused (or asked
    to stop) while its thread is still inside torch would otherwise exit under it, and
    the interpreter aborts at exit ("terminate called without an active exception")."""
    if not build.done():
        log.info("waiting for the model build to finish before leaving")
        await asyncio.wait({build}, timeout=_BUILD_WAIT_S)
    if build.done() and not build.cancelled():
        build.exception()  # retrieved: its failure, if any, was said or is moot now


class ClusterRefused(LocalError):
    """The cluster refused this member (another secret, or another workload)."""

    exit_code = 3


class Generations(Protocol):
    """What trains the member's generations: the cluster's own :class:`~.training.Replica`,
    or a pod trainer in a p2ptrain network (``p2ptrain cluster --experiment``)."""

    #: The steps (or windows) completed, as this member tells the others.
    completed_step: int

    def run(
        self,
        plan: GenerationPlan,
        rank: int,
        *,
        store: Any,
        vote: Callable[[], bool],
        on_step: Callable[[StepReport], None],
    ) -> Outcome:
        """Train generation ``plan`` as ``rank`` until it ends (blocking: a thread's)."""
        ...


def _build_replica(settings: ClusterSettings, host: str) -> Generations:
    from p2ptrain.cluster.training import build_replica

    return build_replica(settings, host)


class ClusterMember:
    """One member of a home cluster (see the module docstring)."""

    def __init__(
        self,
        settings: ClusterSettings,
        identity: Identity,
        *,
        on_event: Callable[[events.ClusterEvent], None],
        clock: Callable[[], float] = time.monotonic,
        build: Callable[[ClusterSettings, str], Generations] = _build_replica,
    ) -> None:
        self.settings, self.identity, self._emit, self._clock = settings, identity, on_event, clock
        self._build = build
        self.me = identity.peer_id
        self.host = settings.host or lan_address()
        self._roster = Roster(me=self.me, ask=self._ask, on_event=on_event)
        self._endpoint = ControlEndpoint(
            identity=identity,
            secret=settings.secret,
            cluster_id=settings.cluster_id,
            handler=self._answer,
            on_refused=self._roster.refused_client,
        )
        self.address = ""
        self._desk = JoinDesk(self.me, clock)
        self._replica: Generations | None = None
        self._since: int | None = None
        self._generation = -1
        self._leader: str | None = None
        self._ended: tuple[GenerationPlan, str] | None = None  # to report who was lost
        self._training = self._leaving = False
        self._vote = threading.Event()
        self._started = self._forming_since = clock()
        self._task: asyncio.Task[Any] | None = None

    # -- what the member says of itself -------------------------------------------------------

    def _info(self) -> MemberInfo:
        replica = self._replica
        return MemberInfo(
            peer_id=self.me,
            address=self.address,
            since=self._since,
            completed_step=0 if replica is None else replica.completed_step,
            generation=self._generation,
            settings=self.settings.fingerprint,
            ready=replica is not None,
            leader=self._leader,
            training=self._training,
        )

    def leave(self) -> None:
        """Stop at the next step boundary (or at once when not training); asked a second
        time, stop at once (a collective may be stuck until its timeout)."""
        if self._leaving and self._task is not None:
            self._task.cancel()
        self._leaving = True
        self._update_vote()
        self._desk.notify()

    # -- the member's life ---------------------------------------------------------------------

    async def run(self) -> int:
        """Run until the steps are done or :meth:`leave`; returns the last completed step."""
        self.address = await self._endpoint.start(self.host, self.settings.port)
        self._roster.own_address = self.address
        self._started = self._forming_since = self._clock()
        self._emit(events.Started(peer=self.me, address=self.address, cluster=self.settings.name))
        for peer in self.settings.peers:
            self._roster.learn(peer)
        discovery = self._discovery()
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.leave)
        build: asyncio.Future[Generations] | None = None
        try:
            if discovery is not None:
                await discovery.start()
            build = start_in_thread("build", self._build, self.settings, self.host)
            return await self._lifecycle(build)
        finally:
            if build is not None:
                await _built(build)
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
            if discovery is not None:
                await discovery.stop()
            await self._endpoint.stop()

    def _discovery(self) -> LanDiscovery | None:
        """mDNS on the interfaces asked for, else on --host's, else on all."""
        chosen = self.settings.mdns_interfaces or ((self.host,) if self.settings.host else None)
        return LanDiscovery(
            network_id=self.settings.cluster_id,
            peer_id=self.me,
            port=int(self.address.rpartition(":")[2]),
            addresses=[self.host],
            interfaces=None if chosen is None else list(chosen),
            on_found=self._lan_peer,
        ) if self.settings.mdns else None  # fmt: skip

    def _lan_peer(self, peer: LanPeer) -> None:
        self._roster.learn(peer.address.partition("://")[2])
        self._desk.notify()

    async def _lifecycle(self, build: asyncio.Future[Generations]) -> int:
        while True:
            formed = await self._form(build)
            if formed is None:
                break
            outcome = await self._train(*formed)
            if outcome.ended == "done":
                self._emit(events.Stopped(step=outcome.completed_step, reason=outcome.reason))
                return outcome.completed_step
            if self._leaving:
                break
        step = 0 if self._replica is None else self._replica.completed_step
        self._emit(events.Stopped(step=step, reason="asked to stop"))
        return step

    # -- probing, election, rendezvous ---------------------------------------------------------

    async def _probe(self) -> None:
        await self._roster.probe(self._info())
        if self._ended is not None:
            plan, reason = self._ended
            self._ended = None
            for peer in lost_members(plan.members, self._roster.views, me=self.me):
                self._emit(events.MemberLost(peer=peer, generation=plan.number, reason=reason))
        self._check_refused()

    def _check_refused(self) -> None:
        why = decide_refused(
            self._clock(),
            not_before=self._started + self.settings.discovery_s,
            trained=self._generation >= 0,
            proven=len(self._roster.found),
            differing=self._roster.differs,
        )
        if why is not None:
            self._emit(events.Refused(address="the cluster", reason=why, fatal=True))
            raise ClusterRefused(why)

    async def _ask(self, address: str, request: Request, timeout_s: float) -> tuple[str, Reply]:
        return await ask(
            address,
            request,
            identity=self.identity,
            secret=self.settings.secret,
            cluster_id=self.settings.cluster_id,
            timeout_s=timeout_s,
        )

    def _follow_leader(self, leader: str, reason: str) -> None:
        if leader != self._leader:
            self._leader = leader
            self._emit(events.LeaderElected(leader=leader, reason=reason))
            self._desk.notify()  # join requests held by this member look again

    async def _form(self, build: asyncio.Future[Generations]) -> tuple[GenerationPlan, Any] | None:
        while not self._leaving:
            changed = self._desk.changed
            await self._probe()
            if not build.done():
                await asyncio.wait({build}, timeout=ROUND_S)
                continue
            if self._replica is None:
                self._replica = build.result()
                self._forming_since = self._clock()  # settle_s counts from being ready
            me = self._info().member()
            leader = elect([me, *self._roster.members()])
            self._follow_leader(leader.peer_id, "the most senior member alive")
            if leader.peer_id == self.me:
                formed = await self._lead()
            else:
                plan = await ask_to_join(
                    leader.address, leader.peer_id, me=self._info, roster=self._roster,
                    leaving=lambda: self._leaving, clock=self._clock,
                )  # fmt: skip
                formed = None if plan is None else (plan, None)
            if formed is not None:
                return formed
            await self._desk.wait(changed, ROUND_S)
        return None

    async def _lead(self) -> tuple[GenerationPlan, Any] | None:
        next_probe = self._clock() + 1.0
        last_reason = ""
        while not self._leaving:
            changed, now = self._desk.changed, self._clock()
            asked = self._desk.asked()
            form, reason = decide_forming(
                now,
                forming_since=self._forming_since,
                not_before=self._started + self.settings.discovery_s,
                settle_s=self.settings.settle_s,
                alive=self._roster.views.keys(),
                asked=asked.keys(),
                wait_for=self.settings.wait_for,
                first=self._generation < 0,
            )
            if reason != last_reason:
                log.info("cluster: %s", reason)
                last_reason = reason
            if form:
                self._check_refused()
                return self._open_generation(asked)
            await self._desk.wait(changed, min(ROUND_S, next_probe - now))
            if self._clock() >= next_probe:
                await self._probe()
                me = self._info().member()
                if elect([me, *self._roster.members()]).peer_id != self.me:
                    return None
                next_probe = self._clock() + 1.0
        return None

    def _open_generation(self, asked: dict[str, MemberInfo]) -> tuple[GenerationPlan, Any]:
        me = self._info().member()
        others = [info.member() for info in asked.values()]
        plan = plan_generation(next_generation([me, *others]), me, others)
        store = open_generation_store(self.host, self.settings.collective_timeout_s)
        plan = msgspec.structs.replace(plan, store_host=self.host, store_port=int(store.port))
        self._desk.formed(plan)  # the join requests waiting now get their answer
        return plan, store

    # -- answering other members ---------------------------------------------------------------

    async def _answer(self, peer: str, request: Request) -> Reply:
        info = request.member
        self._roster.learn(info.address)
        for known in request.known:
            self._roster.learn(known)
        if info.settings != self.settings.fingerprint:
            return Incompatible(
                reason=f"the member at {self.address} trains another workload, config, seed or "
                "compression: start every member with the same --workload, --config, --seed "
                "and --compression"
            )
        if isinstance(request, StatusRequest):
            return StatusReply(member=self._info(), known=self._roster.known())
        return await self._desk.answer(
            peer,
            info,
            leading=lambda: self._leader == self.me and not self._leaving,
            settled=lambda: self._training or self._leaving,
            leader_address=lambda: self._roster.address_of(self._leader),
            on_request=self._update_vote,
        )

    # -- training ------------------------------------------------------------------------------

    def _update_vote(self) -> None:
        plan = self._desk.plan
        if not self._training or plan is None:
            return
        waiting = self._desk.asked() if plan.leader == self.me else {}
        vote, reason = decide_reform(plan.members, waiting, leaving=self._leaving)
        if vote and not self._vote.is_set():
            log.info("cluster: ending generation %d at the next step: %s", plan.number, reason)
            self._vote.set()

    async def _train(self, plan: GenerationPlan, store: Any) -> Outcome:
        rank = plan.rank_of(self.me)
        replica = self._replica
        assert rank is not None and replica is not None
        self._desk.plan, self._generation, self._since = plan, plan.number, plan.since[rank]
        self._follow_leader(plan.leader, f"leader of generation {plan.number}")
        self._training = True
        self._vote.clear()
        self._update_vote()
        self._emit(events.GenerationFormed(
            generation=plan.number, world=plan.world, rank=rank, leader=plan.leader,
            start_step=plan.start_step, members=plan.members,
            compression=self.settings.compression,
        ))  # fmt: skip
        loop = asyncio.get_running_loop()

        def on_step(report: StepReport) -> None:
            loop.call_soon_threadsafe(self._emit, events.Step(
                generation=report.generation, step=report.step, loss=report.loss,
                seconds=report.seconds,
            ))  # fmt: skip

        watch = asyncio.ensure_future(self._watch(plan))  # owned here: cancelled below
        try:
            running = start_in_thread(
                "train", replica.run, plan, rank, store=store, vote=self._vote.is_set,
                on_step=on_step,
            )  # fmt: skip
            outcome = await running
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            self._training = False
            self._desk.plan = None
            self._forming_since = self._clock()
            self._desk.notify()
        if outcome.ended != "done":
            self._ended = (plan, outcome.reason)
        return outcome

    async def _watch(self, plan: GenerationPlan) -> None:
        """While training: probe now and then, and end the generation when a member more
        senior than its leader is alive outside it (two halves of a cluster merge). A pod
        trainer's generation also ends when a member of it missed two probes in a row: a
        pod's ranks wait for rank 0's next window for as long as the network takes, so a
        vanished machine would not fail a collective soon."""
        leader = Member(plan.leader, "", plan.since[0], 0, plan.number)
        missed: dict[str, int] = {}
        while not self._vote.is_set():
            await asyncio.sleep(WATCH_S)
            await self._probe()
            outside = [m for m in self._roster.members() if m.peer_id not in plan.members]
            if outside and seniority(elect(outside)) < seniority(leader):
                log.info("cluster: a member more senior than the leader is alive; merging")
                self._vote.set()
            if self.settings.experiment is None:
                continue
            lost = lost_members(plan.members, self._roster.views, me=self.me)
            missed = {peer: missed.get(peer, 0) + 1 for peer in lost}
            if any(count >= 2 for count in missed.values()):
                log.info("cluster: member(s) %s stopped answering; re-forming the pod",
                         ", ".join(p[:12] for p in missed))  # fmt: skip
                self._vote.set()
