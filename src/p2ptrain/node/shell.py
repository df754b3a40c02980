"""The running node: a thin shell around one runner per role.

A :class:`Node` owns the network (:class:`~p2ptrain.net.node.NetNode`: server, gossip,
discovery), its data directory and the :class:`~.services.PeerServices` its roles share, and
holds one runner per role machine (DESIGN §2; which runner for which roles: :mod:`.roles`).

One identity, one server, one store. The shell checks every gossip message against the
experiment's intake rules (the topic validator: nothing is kept or forwarded before it
passed them, :mod:`p2ptrain.protocol.intake`), and hands each message to every runner
(gossip hands a node its own messages too, so what one role publishes reaches the others).
It persists each certified head once (whichever role adopted it first) and prunes the
updates and proposals of older windows (and, after each adoption, has the blobs it no
longer needs deleted: :mod:`.collector`), emits one ``adopted`` event per height, takes in
and stores the metrics reports of certified heads (:mod:`p2ptrain.protocol.metrics`; with
``--evaluate`` it evaluates each adopted head itself: :mod:`.evaluator`), answers
``/v1/status``, ``/v1/records/`` and ``/v1/network``, asks a peer now and then
whether the chain moved past it, and writes ``status.json``.

Its runners own their tasks (:mod:`.runner`); a role that fails too often in a row ends
:meth:`Node.run` with :class:`~.failures.RoleFailed` after the node stopped cleanly.

Persistence happens before the action that depends on it; a node started again on its data
directory re-verifies its stored chain from genesis and resumes from the last certified head
it adopted, then catches up with its peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable

import torch
from prometheus_client.core import Metric

from p2ptrain.aggregate.codecs import max_update_bytes
from p2ptrain.core.certificate import CertifiedLink, QuorumCertificate
from p2ptrain.core.encoding import encode
from p2ptrain.core.envelope import Signed
from p2ptrain.core.records import Attestation, Head, MetricsReport, Proposal, Update
from p2ptrain.core.tensors import schema_of
from p2ptrain.errors import LocalError, ProtocolViolation, TransportError
from p2ptrain.net.client import MAX_WINDOW_IDS, WindowRecords
from p2ptrain.net.config import NetConfig
from p2ptrain.net.content import Answer, text_answer
from p2ptrain.net.gossip import CERTIFICATE_KIND, Delivered, Refusal
from p2ptrain.net.net_metrics import exposition
from p2ptrain.net.node import NetNode
from p2ptrain.net.wire_meter import loop_meter
from p2ptrain.node.collector import BlobCollector, CollectorStatistics
from p2ptrain.node.evaluator import HeadEvaluator
from p2ptrain.node.failures import FailureBook, RoleFailed
from p2ptrain.node.persist import METRICS_KIND, NodeStore
from p2ptrain.node.roles import role_runners
from p2ptrain.node.runner import RoleRunner
from p2ptrain.node.services import NothingAbove, PeerServices
from p2ptrain.node.setup import NodeSettings, Prepared
from p2ptrain.node.shard_cache import ShardCache
from p2ptrain.node.trainer_runner import TrainerRunner
from p2ptrain.observe.dashboard import Dashboard, Snapshot, start_listener, write_peers
from p2ptrain.observe.events import (
    CatchingUp,
    HeadAdopted,
    NodeEvent,
    Published,
    Ready,
    RoleFailure,
    Stopped,
    Trained,
    update_outcome,
)
from p2ptrain.observe.status import (
    STATUS_FILE,
    Connections,
    LastWindow,
    NodeStatus,
    OpenWindow,
    ValidationMetrics,
    encode_status,
)
from p2ptrain.observe.telemetry import NodeTelemetry, node_families
from p2ptrain.observe.window_history import PeerView
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.intake import IntakeRules
from p2ptrain.protocol.metrics import MetricsBook, median
from p2ptrain.protocol.retention import KeepSet, pinned_blobs, unknown_grace_s
from p2ptrain.protocol.role import RoleMachine
from p2ptrain.store.atomic import overwrite_in_place, write_atomically
from p2ptrain.torch.workload import Workload

__all__ = ["Node"]

#: The status file is padded to whole pages of this size (rewritten in place on a full disk).
_STATUS_PAGE = 4096

logger = logging.getLogger(__name__)

_EXPERIMENT_KINDS = ("update", "proposal", "attestation", METRICS_KIND, CERTIFICATE_KIND)
#: The roles that use (and so keep and serve) the window's updates and proposals.
_PARTICIPANT_ROLES = frozenset({"reducer", "validator"})
_STATUS_EVERY_S = 2.0
#: A trainer not heard from for this many heartbeats (it announces itself every heartbeat)
#: is no longer expected to report: the open window may close without it.
PRESENCE_HEARTBEATS = 3
#: After its last window a serving node stays up until no blob was fetched for this long
#: (peers fetch the last head's weights), and never longer than the maximum.
_LINGER_QUIET_S = 3.0
_LINGER_MAX_S = 30.0


class Node:
    """One node. ``await node.run()`` until :meth:`stop` (or the ``windows`` target)."""

    def __init__(
        self,
        settings: NodeSettings,
        prepared: Prepared,
        store: NodeStore,
        *,
        workload: Workload | None = None,
        shards: ShardCache | None = None,
        evaluator_workload: Workload | None = None,
        on_event: Callable[[NodeEvent], None] | None = None,
    ) -> None:
        """``workload``: the trainer's; ``shards``: the trainer's cache of a prepared
        dataset's shards; ``evaluator_workload``: a workload of its own for the evaluator
        (``--evaluate``; None: this node evaluates nothing)."""
        self.settings = settings
        self.identity = prepared.identity
        self.peer_id = prepared.identity.peer_id
        self.network = prepared.network
        self.manifest = prepared.experiment.record
        self.experiment_id = prepared.experiment.record_id
        self.store = store
        self._on_event = on_event
        self._stop = asyncio.Event()
        self._target_reached = False
        #: Why the node stopped by itself ('' while running, or stopped from outside).
        self.stop_reason = ""
        #: Windows still to take part in (``settings.windows``), and the height at which
        #: that many were certified here (the node stops once every role adopted it).
        self._windows_left = settings.windows
        self._target_height = settings.until_height
        self._stored_height = 0
        self._adopted_height = 0
        #: Heads adopted since the node started (once each, whichever role was first).
        self._heads_adopted = 0
        #: The height adopted last (None before the first adoption, restored or not).
        self._last_height: int | None = None
        self._last_window: LastWindow | None = None
        #: Our own updates by window (a trainer's), until their window is adopted.
        self._published: dict[int, str] = {}
        self._window_started = time.monotonic()
        self._failed: RoleFailed | None = None
        roles = set(settings.roles)
        self.failures = FailureBook(settings.max_role_failures)
        #: Counters, timings and the window history (status, /metrics, the dashboard).
        pinned = {shard.blob_id: "shard" for shard in self.manifest.dataset.shards}
        pinned[self.manifest.genesis_weights] = "state"
        self.telemetry = NodeTelemetry(settings.data_dir, pinned)
        self._wire_high = (0, 0)
        #: Where ``--metrics-listen`` serves (once the node runs).
        self.metrics_address: str | None = None
        self.intake = IntakeRules(
            self.manifest,
            self.experiment_id,
            max_update_bytes=max_update_bytes(self.manifest.codec, schema_of(prepared.genesis)),
        )
        self.services = PeerServices(
            identity=self.identity,
            store=store,
            experiment_id=self.experiment_id,
            bootstrap=settings.bootstrap,
            keeps_records=bool(roles & _PARTICIPANT_ROLES),
            emit=self._emit,
            # records fetched by a window sync pass the same intake as gossip
            admit=lambda signed: self.intake.judge(signed, self.height + 1),
            on_adopted=self._adopted,
            on_update=self._saw_update,
            telemetry=self.telemetry,
        )
        #: Deletes the blobs the node no longer needs (None: an archive node keeps all).
        self.collector: BlobCollector | None = None
        if not settings.archive:
            self.collector = BlobCollector(
                store.blobs,
                keep_heads=settings.keep_heads,
                pinned=pinned_blobs(self.manifest),
                grace_s=unknown_grace_s(self.manifest.window),
                storage=self.services.storage,
            )
        self.runners = role_runners(
            settings.roles,
            prepared,
            workload,
            services=self.services,
            failures=self.failures,
            emit=self._emit,
            votes=store.votes(),
            shards=shards,
            presence_timeout_s=(
                PRESENCE_HEARTBEATS * settings.heartbeat_s if settings.close_early else None
            ),
        )
        #: The metrics reports of recent certified heads (what is stored is in the store).
        self.metrics: MetricsBook[Signed[MetricsReport]] = MetricsBook()
        self.evaluator: HeadEvaluator | None = None
        if evaluator_workload is not None:
            self.evaluator = HeadEvaluator(
                workload=evaluator_workload,
                manifest=self.manifest,
                identity=self.identity,
                services=self.services,
                failures=self.failures,
                emit=self._emit,
            )
        self._net: NetNode | None = None

    # -- life cycle -----------------------------------------------------------------------

    @property
    def net(self) -> NetNode:
        if self._net is None:
            raise LocalError("the node is not running")
        return self._net

    @property
    def height(self) -> int:
        """The highest certified head the node holds."""
        return max(r.machine.chain.height for r in self.runners)

    def stop(self) -> None:
        """Ask :meth:`run` to return (safe from a signal handler on the loop)."""
        self._stop.set()

    async def run(self) -> NodeStatus:
        """Run until stopped; return the final status. Raises :class:`RoleFailed` (after
        stopping cleanly) when a role failed too many steps in a row."""
        s = self.settings
        config = NetConfig(
            host=s.host,
            port=s.port,
            advertise=s.advertise,
            bootstrap=s.bootstrap,
            mdns=s.mdns,
            heartbeat_s=s.heartbeat_s,
            # a restarted node keeps its address when it can (seeds above all: every
            # peer's bootstrap names it)
            preferred_port=self.store.listen_port() if s.host is not None else 0,
        )
        torch.set_num_threads(max(1, s.threads))
        # the server's own /metrics answers loopback only: the dashboard adds none
        dashboard = Dashboard(self.dashboard_snapshot)
        net = NetNode(
            identity=self.identity,
            network=self.network.record,
            blobs=self.store.blobs,
            config=config,
            roles=s.roles,
            secret=s.secret,
            relay=s.relay,
            answers={
                "/v1/records/": self._answer_record,
                "/v1/window/": self._answer_window,
                "/v1/status": self._answer_status,
                "/v1/network": self._answer_network,
            },
            on_blob_bytes=self.telemetry.blob_bytes,
            extra_routes=dashboard.routes(),
            metrics_text=self.metrics_text,
        )
        self._net = net
        self.services.attach(net, s.fetch_timeout_s)
        async with net, self._metrics_listener(), _closed_after(dashboard):
            if s.host is not None and s.port == 0:
                self.store.remember_listen_port(net.port)
            net.serve_chain(self._serving().machine.chain)
            net.gossip.subscribe(self.services.topic, self._on_message, self._check_message)
            self._restore()
            self._emit(
                Ready(
                    peer_id=self.peer_id,
                    address=net.address,
                    experiment_id=self.experiment_id,
                    height=self.height,
                    roles=tuple(s.roles),
                    metrics_address=self.metrics_address,
                )
            )
            self._check_target(at_start=True)
            await self._run_roles()
            if self._target_reached and self._failed is None:
                await self._linger()
            status = self.status()
            self._write_status(status)
        failed = None if self._failed is None else str(self._failed)
        self._emit(Stopped(peer_id=self.peer_id, height=self.height, failed=failed))
        if self._failed is not None:
            raise self._failed
        return status

    def _serving(self) -> RoleRunner:
        """The runner whose chain is ahead (a participant's, on a tie: it computes heads)."""
        return max(self.runners, key=lambda r: r.machine.chain.height)

    async def _run_roles(self) -> None:
        """The runners and the node's own tasks, until stopped or a role failed."""
        try:
            async with asyncio.TaskGroup() as group:
                for runner in self.runners:
                    group.create_task(runner.run(), name=runner.role)
                group.create_task(self._sync_forever(), name="sync")
                group.create_task(self._status_forever(), name="status")
                if self.collector is not None:
                    snapshot = functools.partial(self._keep_set, self.collector)
                    group.create_task(self.collector.run(snapshot), name="collector")
                if self.evaluator is not None:
                    group.create_task(self.evaluator.run(), name="evaluator")
                await self._stop.wait()
                raise _Stopping
        except* _Stopping:
            pass
        except* RoleFailed as failures:
            first = failures.exceptions[0]
            assert isinstance(first, RoleFailed)
            self._failed = first
            logger.error("%s", first)

    def _restore(self) -> None:
        """Resume from the stored chain (verified again from genesis), or start fresh."""
        now = time.monotonic()
        links, state = self._resumable(self.store.links(self.experiment_id))
        if links and state is not None:
            tip = links[-1][0]
            weights, optimizer = state
            self._stored_height = tip.height
            self.telemetry.history.load()
            parent: Head | None = None
            for head, _ in links:
                self.telemetry.count_head(head, parent)
                parent = head
            for runner in self.runners:
                actions = runner.machine.receive_chain(
                    now, links, weights, optimizer, self.identity.public_key
                )
                if runner.machine.chain.height != tip.height:
                    raise LocalError(
                        f"the stored chain in {self.settings.data_dir} does not verify "
                        f"({actions}); move the data directory away and join again"
                    )
                runner.execute(runner.policy.carry(now, actions))
            logger.info("resumed at height %d (head %s)", tip.height, tip.id[:12])
        self._last_height = self._stored_height  # windows are counted from here
        floor = self._stored_height - self.metrics.keep_heights
        self.metrics.load(self.store.metrics_reports(self.experiment_id, min_height=floor))
        if links and self.evaluator is not None:
            tip = links[-1][0]
            if self.identity.public_key not in self._evaluators_of(tip.id):
                self.evaluator.offer(tip.height, tip.id, tip.weights_blob)
        for runner in self.runners:
            runner.start(now)
        if self.collector is not None:
            self.collector.request()  # what an earlier run left

    # -- gossip in ------------------------------------------------------------------------

    def _resumable(
        self, links: list[tuple[Head, QuorumCertificate]]
    ) -> tuple[list[tuple[Head, QuorumCertificate]], tuple[bytes, bytes | None] | None]:
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

    def _check_message(self, message: Delivered) -> str | Refusal | None:
        """The topic validator, before anything is kept or forwarded: None to accept, else
        why not and whom it counts against (:mod:`p2ptrain.protocol.intake`)."""
        if message.kind not in _EXPERIMENT_KINDS:
            return f"{message.kind!r} does not travel on an experiment topic"
        record = message.record
        if isinstance(record, CertifiedLink):
            verdict = record.check(self.manifest, self.experiment_id)
            return None if verdict else f"bad certificate: {verdict.reason}"
        admission = self.intake.judge(record, self.height + 1)
        if admission.accepted and isinstance(record.record, MetricsReport):
            admission = self.metrics.judge(record.record, self.height, self._certified_at)
        return None if admission.accepted else Refusal(admission.reason, admission.blame)

    def _saw_update(self, update: Update) -> None:
        """An update record a role keeps: its blob is that window's (the collector's)."""
        if self.collector is not None:
            self.collector.saw_update(update)

    def _certified_at(self, height: int) -> str | None:
        link = self._serving().machine.chain.at(height)
        return None if link is None else link.head_id

    def _on_message(self, message: Delivered) -> None:
        record = message.record
        if not isinstance(record, CertifiedLink) and isinstance(record.record, MetricsReport):
            self._take_report(record)
            return  # beside the chain: no role machine has a use for it
        if not isinstance(record, CertifiedLink):
            inner, now = record.record, time.monotonic()
            if isinstance(inner, Update):
                self.services.on_update(inner)  # its blob is that window's
                self.telemetry.saw_update(record.record_id, inner, now)
            elif isinstance(inner, Proposal):
                self.telemetry.saw_proposal(inner, now)
            elif isinstance(inner, Attestation):
                self.telemetry.saw_attestation(inner.height, now)
            if self.settings.archive and isinstance(inner, Update | Proposal):
                self.store.put_signed(
                    record.record_id,
                    message.kind,
                    bytes(record.envelope.encode()),
                    self.experiment_id,
                    inner.window,
                )
        origin = self.services.published_by(message)  # it holds its own record already
        for runner in self.runners:
            if runner.role != origin:
                runner.receive(message)

    # -- metrics reports ------------------------------------------------------------------

    def _take_report(self, signed: Signed[MetricsReport]) -> None:
        """A report that passed intake (or our own): stored if its head is certified here,
        held until it is if it names the next height."""
        report = signed.record
        if report.height > self.height:
            self.metrics.hold(signed.record_id, report, signed)
        else:
            self._keep_report(signed)

    def _keep_report(self, signed: Signed[MetricsReport]) -> None:
        report = signed.record
        if report.head_id != self._certified_at(report.height) or not self.metrics.add(report):
            return  # a duplicate, a full head, or a head not (or no longer) ours
        self._show_validation(report.head_id)
        try:
            self.store.put_report(signed)
        except Exception as exc:  # a report is worth a warning, never the node
            if not self.services.storage.check("storing a metrics report", exc):
                logger.warning("storing the metrics report of head %d: %s", report.height, exc)
        else:
            self.services.storage.succeeded()

    def _show_validation(self, head_id: str) -> None:
        """The window history shows the median of the reports kept for ``head_id``."""
        losses = self.metrics.losses(head_id)
        if (loss := median(losses)) is not None:
            self.telemetry.history.set_validation(head_id, loss, len(losses))

    def _evaluators_of(self, head_id: str) -> set[bytes]:
        return {r.evaluator for r in self.store.reports_for(head_id)}

    # -- adoption -------------------------------------------------------------------------

    def _adopted(self, machine: RoleMachine, action: act.Adopted) -> None:
        """A role's machine adopted a head: store it (once), tell whoever listens (once)."""
        head, blobs = action.head, self.store.blobs
        held = blobs.has(head.weights_blob) and (
            head.optimizer_blob is None or blobs.has(head.optimizer_blob)
        )
        state = None if held else machine.state_of(action.head_id)
        for blob in state or ():
            if blob is not None:
                blobs.put(blob)
        if head.aggregate_blob is not None and not blobs.has(head.aggregate_blob):
            aggregate = machine.aggregate_of(action.head_id)
            if aggregate is not None:  # peers that hold the parent fetch only this
                blobs.put(aggregate)
        # links up to the adopted head (its state is held): a restart resumes from there
        for height in range(self._stored_height + 1, head.height + 1):
            link = machine.chain.at(height)
            if link is not None and link.certificate is not None:
                self.store.put_link(link.head, link.certificate)
                self._stored_height = height
                before = machine.chain.at(height - 1)
                self.telemetry.certified(
                    link.head,
                    link.head_id,
                    None if before is None else before.head,
                    link.certificate,
                    reason=action.reason if height == head.height else "caught up",
                    wire=self._wire_bytes(),
                    now=time.monotonic(),
                )
                self._show_validation(link.head_id)  # reports that came before it
                if not self.settings.archive:  # older windows' records are of no use now
                    self.store.prune_signed(self.experiment_id, height)
                for waiting in self.metrics.certified(height, link.head_id):
                    self._keep_report(waiting)
        if head.height > self._adopted_height:
            self._adopted_height = head.height
            self._heads_adopted += 1
            self._count_window(head.height, stepped=not machine.catching_up)
            now = time.monotonic()
            window = LastWindow(
                height=head.height,
                head_id=action.head_id,
                accepted=len(head.accepted),
                quarantined=len(head.quarantine),
                reason=action.reason,
                seconds=round(now - self._window_started, 2),
            )
            self._last_window, self._window_started = window, now
            self._emit(
                HeadAdopted(
                    peer_id=self.peer_id,
                    height=window.height,
                    head_id=window.head_id,
                    accepted=window.accepted,
                    quarantined=window.quarantined,
                    reason=window.reason,
                    seconds=window.seconds,
                    update=update_outcome(
                        head,
                        self._published.pop(head.height, None),
                        self.peer_id,
                        parent.head if (parent := machine.chain.at(head.height - 1)) else None,
                    ),
                )
            )
            for old in [w for w in self._published if w < head.height]:
                del self._published[old]
            self._write_status(self.status())
            if self.evaluator is not None:
                self.evaluator.offer(head.height, action.head_id, head.weights_blob)
        if self.collector is not None:
            self.collector.request()
        self._check_target()

    def _keep_set(self, collector: BlobCollector) -> KeepSet:
        """What the node keeps now: the blobs of its chain's last heads and of the heads its
        roles build on, the updates of recent windows and ours still being pushed, genesis and
        the dataset's shards."""
        chain = self._serving().machine.chain

        def head_at(height: int) -> Head | None:
            link = chain.at(height)
            return None if link is None else link.head

        in_use = [runner.machine.base.head for runner in self.runners]
        sending = [b for r in self.runners if isinstance(r, TrainerRunner) for b in r.pushing]
        return collector.snapshot(chain.height, head_at, in_use, sending)

    def _count_window(self, height: int, *, stepped: bool) -> None:
        """A head was adopted: one more window taken part in when it followed the one
        before (not a restored head, nor a jump while catching up)."""
        last, self._last_height = self._last_height, height
        if self._windows_left is None or last is None or height != last + 1 or not stepped:
            return
        self._windows_left -= 1
        if self._windows_left <= 0 and self._target_height is None:
            self._target_height = height

    def _check_target(self, *, at_start: bool = False) -> None:
        target = self._target_height
        if target is None:
            return
        heights = [r.machine.base.head.height for r in self.runners]
        if min(heights) < target:
            return
        if self.settings.windows is not None:
            self.stop_reason = f"took part in {self.settings.windows} windows"
        elif at_start:
            self.stop_reason = (
                f"nothing to do: already at height {max(heights)}, at or past the height "
                f"to stop at ({target}); ask for more windows (--windows N) or a higher "
                "--until-height"
            )
            logger.warning("%s", self.stop_reason)
        else:
            self.stop_reason = f"reached height {target}"
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

    # -- timers ---------------------------------------------------------------------------

    async def _sync_forever(self) -> None:
        """Missed a certificate (or restarted)? Ask a peer now and then whether the chain
        moved past us; answers are verified link by link by each role's machine."""
        rng = self.services.rng
        while True:
            providers = self.services.providers()
            try:
                if providers:
                    # two at random, hedged: a hung or trickling one costs a second
                    page = await self.services.fetch_chain(
                        lambda: min(r.machine.chain.height for r in self.runners),
                        among=rng.sample(providers, min(2, len(providers))),
                    )
                    for runner in self.runners:
                        runner.offer_links(page)
            except NothingAbove as exc:  # the usual answer: we are at the tip
                logger.debug("sync: %s", exc)
            except Exception as exc:  # never the end of the node: the next round tries again
                if self.services.storage.check("catching up", exc):
                    pass
                elif isinstance(exc, TransportError | ProtocolViolation):
                    logger.info("sync: %s", exc)
                else:
                    logger.exception("sync failed")
            await asyncio.sleep(self.settings.sync_interval_s * (0.75 + rng.random() / 2))

    async def _status_forever(self) -> None:
        try:
            await asyncio.to_thread(self.store.blobs.usage)  # counted off the loop, once
        except OSError as exc:  # counted again when the status asks
            logger.warning("counting the blob store: %s", exc)
        while True:
            await asyncio.sleep(_STATUS_EVERY_S)
            try:
                self._write_status(self.status())
            except Exception:  # the status is for people: never the end of the node
                logger.exception("writing the status failed")

    # -- status ---------------------------------------------------------------------------

    def _wire_bytes(self) -> tuple[int, int]:
        """Bytes the node's connections sent and received: TCP payload as the kernel
        counted it, or where it cannot, what the node pushed and gossiped and the uploads
        it took in. Never less than an earlier answer (a closing connection is counted
        once its counters are read)."""
        meter = loop_meter()
        if meter is not None:
            sent, received = meter.totals()
        elif self._net is None:
            sent = received = 0
        else:
            n = self._net.statistics()
            sent = self._net.client.bytes_pushed + n.gossip.bytes_sent
            received = 0 if n.server is None else n.server.bytes_received
        high = self._wire_high
        self._wire_high = (max(high[0], sent), max(high[1], received))
        return self._wire_high

    def status(self) -> NodeStatus:
        net = self._net
        serving = self._serving().machine
        adopted = max((r.machine for r in self.runners), key=lambda m: m.base.head.height)
        tip = serving.chain.tip
        peers = banned = 0
        connections = Connections()
        bytes_sent, bytes_received = self._wire_bytes()
        telemetry = self.telemetry
        sent, received = dict(telemetry.sent), dict(telemetry.received)
        if net is not None:
            n = net.statistics()
            peers, banned = n.peers.peers, n.peers.banned
            connections = Connections(outbound=n.outbound, inbound=n.inbound)
            sent["gossip"] += n.gossip.bytes_sent
            received["gossip"] += n.gossip_bytes_received
        reasons = [r.reason() for r in self.runners]
        trained = next((r.last_trained for r in self.runners if r.last_trained), None)
        data = next(
            (d for r in self.runners if isinstance(r, TrainerRunner) and (d := r.data_status())),
            None,
        )
        usage = self.store.blobs.usage()
        collected = CollectorStatistics() if self.collector is None else self.collector.statistics()
        return NodeStatus(
            peer_id=self.peer_id,
            roles=tuple(self.settings.roles),
            address=None if net is None else net.address,
            experiment_id=self.experiment_id,
            height=tip.head.height,
            head_id=tip.head_id,
            adopted_head_id=adopted.base.head_id,
            peers=peers,
            banned=banned,
            connections=connections,
            last_window=self._last_window,
            # what the open window is doing or why it has no head yet
            open_window=OpenWindow(window=tip.head.height + 1, reason="; ".join(reasons)),
            role_states=tuple(r.state() for r in self.runners)
            + (() if self.evaluator is None else (self.evaluator.state(),)),
            errors=tuple(self.failures.recent),
            failed=None if self._failed is None else str(self._failed),
            reports=tuple(self.services.reports),
            trainer=trained,
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
            wire_measured=loop_meter() is not None,
            pid=os.getpid(),
            storage=self.services.storage.problem,
            store_blobs=usage.blobs,
            store_bytes=usage.bytes,
            blobs_collected=collected.blobs_collected,
            bytes_collected=collected.bytes_collected,
            collect_failures=collected.failures,
            keep_heads=None if self.collector is None else self.collector.keep_heads,
            validation=self._validation(),
            data=data,
            windows_certified=telemetry.windows_certified,
            windows_failed=dict(telemetry.windows_failed),
            updates_accepted=telemetry.updates_accepted,
            updates_rejected=dict(telemetry.updates_rejected),
            quarantined_peers=sum(
                1 for e in tip.head.quarantine if e.until_window > tip.head.height
            ),
            bytes_sent_by_kind=sent,
            bytes_received_by_kind=received,
            role_errors=self.failures.total,
            metrics_address=self.metrics_address,
            chains=len(self.runners),
            heads_adopted=self._heads_adopted,
            outer_steps=sum(r.machine.outer_steps for r in self.runners),
            certificate_checks=sum(r.machine.chain.certificate_checks for r in self.runners),
        )

    def _validation(self) -> ValidationMetrics | None:
        latest = self.metrics.latest()
        if latest is None:
            return None
        return ValidationMetrics(
            height=latest.height,
            head_id=latest.head_id,
            median_loss=latest.median_loss,
            reports=latest.reports,
        )

    def _write_status(self, status: NodeStatus) -> None:
        """Replace the status file; on a full disk, overwrite it in place (its blocks are
        held already: the file is padded to whole pages), so the status still says why."""
        try:
            self.telemetry.history.save()
            write_peers(self.settings.data_dir, self._peer_views())
        except (LocalError, OSError) as exc:
            if not self.services.storage.check("writing the window history", exc):
                logger.warning("%s", exc)
        path = self.settings.data_dir / STATUS_FILE
        data = encode_status(status)
        data += b" " * (-len(data) % _STATUS_PAGE)
        try:
            write_atomically(path, data)
        except LocalError as exc:
            if not self.services.storage.check("writing the status", exc):
                logger.warning("%s", exc)
            try:
                overwrite_in_place(path, data)
            except OSError as again:
                logger.debug("status %s: %s", path, again)
        else:
            self.services.storage.succeeded()

    def _answer_status(self, target: str) -> Answer:
        body = encode_status(self.status())
        return Answer(200, {"Content-Type": "application/json"}, body)

    def _answer_record(self, target: str) -> Answer:
        record_id = target.split("?", maxsplit=1)[0].rsplit("/", 1)[-1]
        raw = self.store.record(record_id) if len(record_id) == 64 else None
        if raw is None:
            return text_answer(404, f"this node does not hold record {record_id[:64]}")
        return Answer(200, {"Content-Type": "application/msgpack"}, raw)

    def _answer_window(self, target: str) -> Answer:
        """``/v1/window/{experiment}/{window}``: the ids of the window's updates and
        proposals kept here (a peer whose window is stuck fetches those it lacks)."""
        parts = target.split("?", maxsplit=1)[0].split("/")
        if len(parts) != 5 or parts[3] != self.experiment_id or not parts[4].isdigit():
            return text_answer(404, "ask /v1/window/{experiment}/{window} of our experiment")
        held = self.store.window_record_ids(self.experiment_id, int(parts[4]), MAX_WINDOW_IDS // 2)
        body = encode(WindowRecords(updates=held["update"], proposals=held["proposal"]))
        return Answer(200, {"Content-Type": "application/msgpack"}, body)

    def _answer_network(self, target: str) -> Answer:
        body = bytes(self.network.envelope.encode())
        return Answer(200, {"Content-Type": "application/msgpack"}, body)

    # -- metrics and the dashboard --------------------------------------------------------

    def metrics_text(self) -> bytes:
        """``/metrics``: the training figures of one status snapshot, the network's own,
        and the phase histograms."""
        status = self.status()

        def families() -> list[Metric]:
            net = [] if self._net is None else list(self._net.metric_families())
            return [*node_families(status), *net]

        return exposition(families, self.telemetry.registry)

    def dashboard_snapshot(self) -> Snapshot:
        return Snapshot(
            status=self.status(),
            peers=self._peer_views(),
            windows=self.telemetry.history.records(),
        )

    def _peer_views(self) -> tuple[PeerView, ...]:
        net = self._net
        peers: list[PeerView] = []
        if net is not None:
            now = time.monotonic()
            connected = net.gossip.connections
            for signed in net.peers:
                record = signed.record
                peers.append(
                    PeerView(
                        peer_id=record.peer_id,
                        roles=tuple(record.roles),
                        connected=record.peer_id in connected,
                        banned=net.peers.banned(record.peer_id, now),
                        address=record.addresses[0] if record.addresses else None,
                    )
                )
        return tuple(peers)

    @contextlib.asynccontextmanager
    async def _metrics_listener(self) -> AsyncIterator[None]:
        """``--metrics-listen``: ``/metrics`` and the dashboard on a listener of their own
        (no credentials asked: the operator chose who can reach it)."""
        where = self.settings.metrics_listen
        if where is None:
            yield
            return
        listener = await start_listener(where, self.dashboard_snapshot, self.metrics_text)
        self.metrics_address = listener.address
        try:
            yield
        finally:
            await listener.stop()

    def _emit(self, event: NodeEvent) -> None:
        now = time.monotonic()
        if isinstance(event, Trained):
            self.telemetry.trained(event.window, event.inner_seconds or event.seconds, now)
        elif isinstance(event, RoleFailure):
            self.telemetry.window_failed(event.window, "role_error")
        if isinstance(event, Published):
            self.telemetry.published(event.window, now)
            self._published[event.window] = event.update_id
        if self._on_event is not None:
            self._on_event(event)
        if isinstance(event, RoleFailure | CatchingUp):
            self._write_status(self.status())


@contextlib.asynccontextmanager
async def _closed_after(dashboard: Dashboard) -> AsyncIterator[None]:
    """End the dashboard's event streams before the server stops (pages that follow the
    node would hold its shutdown otherwise)."""
    try:
        yield
    finally:
        dashboard.close()


class _Stopping(Exception):
    """Ends the node's task group when :meth:`Node.stop` was called."""
