"""What a node does with the heads its follower adopts: the persistence of the chain.

Each adopted head is stored once with the links up to it (a restart resumes from the
newest head whose state the store still holds, verified again from genesis:
:meth:`ChainKeeper.restore`), the node's other roles learn that the base moved (after the
effects under way: never from inside a handler), the window history and the metrics
reports are told, the records of older windows are pruned (an archive node keeps them), one
``adopted`` event goes out per height, and the node stops once it took part in the windows
it was asked for (``--windows``) or reached ``--until-height`` (serving its last head a
while: :meth:`ChainKeeper.linger`). Now and then it asks a peer whether the chain moved
past it (:meth:`ChainKeeper.sync_forever`), and it says which blobs its chain still needs
(:meth:`ChainKeeper.keep_set`, for the collector).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.records import Head
from p2ptrain.driver.catch_up import NothingAbove, fetch_chain
from p2ptrain.driver.runner import RoleRunner
from p2ptrain.driver.services import PeerServices
from p2ptrain.errors import LocalError, ProtocolViolation, TransportError
from p2ptrain.net.node import NetNode
from p2ptrain.node.collector import BlobCollector
from p2ptrain.node.evaluator import HeadEvaluator
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.reports import ReportKeeper
from p2ptrain.node.setup import NodeSettings
from p2ptrain.node.trainer_runner import TrainerRunner
from p2ptrain.observe.events import HeadAdopted, NodeEvent, update_outcome
from p2ptrain.observe.status import LastWindow
from p2ptrain.observe.telemetry import NodeTelemetry
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.follower import Follower
from p2ptrain.protocol.retention import KeepSet
from p2ptrain.protocol.role import RoleMachine

__all__ = ["ChainKeeper"]

logger = logging.getLogger(__name__)

#: After its last window a serving node stays up until no blob was fetched for this long
#: (peers fetch the last head's weights), and never longer than the maximum.
_LINGER_QUIET_S = 3.0
_LINGER_MAX_S = 30.0

Links = list[tuple[Head, QuorumCertificate]]


class ChainKeeper:
    """Stores and restores a node's chain, and counts the windows it took part in."""

    def __init__(
        self,
        *,
        settings: NodeSettings,
        peer_id: str,
        store: NodeStore,
        follower: Follower,
        runners: Sequence[RoleRunner],
        telemetry: NodeTelemetry,
        reports: ReportKeeper,
        evaluator: HeadEvaluator | None,
        collector: BlobCollector | None,
        emit: Callable[[NodeEvent], None],
        wire_bytes: Callable[[], tuple[int, int]],
        write_status: Callable[[], None],
        stop: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.peer_id = peer_id
        self.store = store
        self.experiment_id = follower.experiment_id
        self.follower = follower
        self.runners = runners
        self.telemetry = telemetry
        self.reports = reports
        self.evaluator = evaluator
        self.collector = collector
        self.emit = emit
        self.wire_bytes = wire_bytes
        self.write_status = write_status
        self.stop = stop
        self.stored_height = 0
        #: Heads adopted since the node started (the follower adopts each height once).
        self.heads_adopted = 0
        self.last_window: LastWindow | None = None
        #: Our own updates by window (a trainer's), until their window is adopted.
        self.published: dict[int, str] = {}
        #: Why the node stopped by itself ('' while running, or stopped from outside).
        self.stop_reason = ""
        self.target_reached = False
        #: Windows still to take part in (``settings.windows``), and the height at which
        #: that many were certified here (the node stops once its follower adopted it).
        self._windows_left = settings.windows
        self._target_height = settings.until_height
        #: The height adopted last (None before the first adoption, restored or not).
        self._last_height: int | None = None
        self._window_started = time.monotonic()

    # -- a restart ------------------------------------------------------------------------

    def restore(self, identity_key: bytes) -> None:
        """Resume from the stored chain (verified again from genesis), or start fresh; then
        start every role."""
        now = time.monotonic()
        links, state = self._resumable(self.store.links(self.experiment_id))
        if links and state is not None:
            tip = links[-1][0]
            weights, optimizer = state
            self.stored_height = tip.height
            self.telemetry.history.load()
            parent: Head | None = None
            for head, _ in links:
                self.telemetry.count_head(head, parent)
                parent = head
            first = self.runners[0]  # takes the chain's inputs for every role
            actions = first.machine.receive_chain(now, links, weights, optimizer, identity_key)
            if self.follower.chain.height != tip.height:
                raise LocalError(
                    f"the stored chain in {self.settings.data_dir} does not verify "
                    f"({actions}); move the data directory away and join again"
                )
            first.execute(first.policy.carry(now, actions))
            logger.info("resumed at height %d (head %s)", tip.height, tip.id[:12])
        self._last_height = self.stored_height  # windows are counted from here
        self.reports.load(self.stored_height)
        if links and self.evaluator is not None:
            tip = links[-1][0]
            if identity_key not in self.reports.evaluators_of(tip.id):
                self.evaluator.offer(tip.height, tip.id, tip.weights_blob)
        for runner in self.runners:
            runner.start(now)
        if self.collector is not None:
            self.collector.request()  # what an earlier run left

    def _resumable(self, links: Links) -> tuple[Links, tuple[bytes, bytes | None] | None]:
        """The stored links up to the highest head whose state the store still holds, and
        that state: a node whose newest state was lost (a full disk, a crash between a
        link and its blobs) resumes from an older head and catches up with its peers."""
        blobs, reason = self.store.blobs, ""
        for index in range(len(links) - 1, -1, -1):
            head = links[index][0]
            try:
                weights = bytes(blobs.get(head.weights_blob))
                optimizer = None
                if head.optimizer_blob is not None:
                    optimizer = bytes(blobs.get(head.optimizer_blob))
            except (OSError, ProtocolViolation) as exc:
                reason = reason or f"the state of stored head {head.height} is gone ({exc})"
                continue
            if reason:
                logger.warning("%s; resuming from height %d and catching up", reason, head.height)
            return links[: index + 1], (weights, optimizer)
        if reason:
            logger.warning("%s; resuming from genesis and catching up", reason)
        return [], None

    # -- adoption -------------------------------------------------------------------------

    def adopted(self, machine: RoleMachine, action: act.Adopted) -> None:
        """The follower adopted a head (through ``machine``'s runner): store it, tell the
        node's other roles (after the effects under way) and whoever listens."""
        loop = asyncio.get_running_loop()
        for runner in self.runners:
            if runner.machine is not machine:
                loop.call_soon(runner.base_moved, action)
        head = action.head  # its state and aggregate are kept (effects before this one)
        self._store_links(head.height, action.reason)
        self.heads_adopted += 1
        self._count_window(head.height, stepped=not self.follower.catching_up)
        now = time.monotonic()
        window = LastWindow(
            height=head.height,
            head_id=action.head_id,
            accepted=len(head.accepted),
            quarantined=len(head.quarantine),
            reason=action.reason,
            seconds=round(now - self._window_started, 2),
        )
        self.last_window, self._window_started = window, now
        parent = self.follower.chain.at(head.height - 1)
        outcome = update_outcome(
            head,
            self.published.pop(head.height, None),
            self.peer_id,
            None if parent is None else parent.head,
        )
        self.emit(
            HeadAdopted(
                peer_id=self.peer_id,
                height=window.height,
                head_id=window.head_id,
                accepted=window.accepted,
                quarantined=window.quarantined,
                reason=window.reason,
                seconds=window.seconds,
                update=outcome,
                weights_blob=head.weights_blob,
            )
        )
        for old in [w for w in self.published if w < head.height]:
            del self.published[old]
        self.write_status()
        if self.evaluator is not None:
            self.evaluator.offer(head.height, action.head_id, head.weights_blob)
        if self.collector is not None:
            self.collector.request()
        self.check_target()

    def _store_links(self, height: int, reason: str) -> None:
        """The links up to the adopted head (its state is held): a restart resumes there."""
        chain = self.follower.chain
        for at in range(self.stored_height + 1, height + 1):
            link = chain.at(at)
            if link is None or link.certificate is None:
                continue
            self.store.put_link(link.head, link.certificate)
            self.stored_height = at
            before = chain.at(at - 1)
            self.telemetry.certified(
                link.head,
                link.head_id,
                None if before is None else before.head,
                link.certificate,
                reason=reason if at == height else "caught up",
                wire=self.wire_bytes(),
                now=time.monotonic(),
            )
            if not self.settings.archive:  # older windows' records are of no use now
                self.store.prune_signed(self.experiment_id, at)
            self.reports.certified(at, link.head_id)  # reports that came before it

    # -- the windows asked for ------------------------------------------------------------

    def _count_window(self, height: int, *, stepped: bool) -> None:
        """A head was adopted: one more window taken part in when it followed the one
        before (not a restored head, nor a jump while catching up)."""
        last, self._last_height = self._last_height, height
        if self._windows_left is None or last is None or height != last + 1 or not stepped:
            return
        self._windows_left -= 1
        if self._windows_left <= 0 and self._target_height is None:
            self._target_height = height

    def check_target(self, *, at_start: bool = False) -> None:
        target = self._target_height
        if target is None:
            return
        height = self.follower.base.head.height
        if height < target:
            return
        if self.settings.windows is not None:
            self.stop_reason = f"took part in {self.settings.windows} windows"
        elif at_start:
            self.stop_reason = (
                f"nothing to do: already at height {height}, at or past the height "
                f"to stop at ({target}); ask for more windows (--windows N) or a higher "
                "--until-height"
            )
            logger.warning("%s", self.stop_reason)
        else:
            self.stop_reason = f"reached height {target}"
        self.target_reached = True
        self.stop()

    # -- timers ---------------------------------------------------------------------------

    async def sync_forever(self, services: PeerServices, interval_s: float) -> None:
        """Missed a certificate (or restarted)? Ask a peer now and then whether the chain
        moved past us; answers are verified link by link by the follower."""
        rng = services.rng
        while True:
            providers = services.providers()
            try:
                if providers:
                    # two at random, hedged: a hung or trickling one costs a second
                    page = await fetch_chain(
                        services,
                        lambda: self.follower.chain.height,
                        among=rng.sample(providers, min(2, len(providers))),
                    )
                    self.runners[0].offer_links(page)
            except NothingAbove as exc:  # the usual answer: we are at the tip
                logger.debug("sync: %s", exc)
            except Exception as exc:  # never the end of the node: the next round tries again
                if services.storage.check("catching up", exc):
                    pass
                elif isinstance(exc, TransportError | ProtocolViolation):
                    logger.info("sync: %s", exc)
                else:
                    logger.exception("sync failed")
            await asyncio.sleep(interval_s * (0.75 + rng.random() / 2))

    def keep_set(self, collector: BlobCollector) -> KeepSet:
        """What the node keeps now: the blobs of its chain's last heads and of the head its
        roles build on, the updates of recent windows and ours still being pushed, genesis and
        the dataset's shards."""
        chain = self.follower.chain

        def head_at(height: int) -> Head | None:
            link = chain.at(height)
            return None if link is None else link.head

        in_use = [self.follower.base.head]
        sending = [b for r in self.runners if isinstance(r, TrainerRunner) for b in r.pushing]
        return collector.snapshot(chain.height, head_at, in_use, sending)

    async def linger(self, net: NetNode) -> None:
        """The last window is done: peers may still need its head's weights from us, so a
        node that serves keeps serving until nobody has fetched a blob for a while."""
        server = net.statistics().server
        if server is None:
            return
        started = last_change = time.monotonic()
        served = server.blobs_served
        while time.monotonic() - last_change < _LINGER_QUIET_S:
            if time.monotonic() - started > _LINGER_MAX_S:
                return
            await asyncio.sleep(0.25)
            now_served = net.statistics().server
            if now_served is not None and now_served.blobs_served != served:
                served, last_change = now_served.blobs_served, time.monotonic()
