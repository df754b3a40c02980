"""The running node: a thin shell that wires its parts and runs them.

A :class:`Node` owns the network (:class:`~p2ptrain.net.node.NetNode`), its data directory,
the :class:`~.services.PeerServices` its roles share, one
:class:`~p2ptrain.protocol.follower.Follower` and one runner per role over it (:mod:`.roles`).
Its parts: gossip in (:mod:`.gossip_in`), the chain's persistence and the windows asked for
(:mod:`.adoption`), the metrics reports (:mod:`.reports`), what the node shows of itself
(:mod:`.status_view`), the blob collector (:mod:`.collector`) and, with ``--evaluate``, the
head evaluator (:mod:`.evaluator`). A role that fails too often in a row ends
:meth:`Node.run` with :class:`~.failures.RoleFailed` after the node stopped cleanly.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import torch

from p2ptrain.aggregate.codecs import max_update_bytes_any
from p2ptrain.core.envelope import Signed
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.records import AdmissionCertificate, Revocation
from p2ptrain.core.tensors import schema_of
from p2ptrain.driver.failures import FailureBook, RoleFailed
from p2ptrain.driver.services import PeerServices
from p2ptrain.driver.storage import StorageHealth
from p2ptrain.errors import LocalError
from p2ptrain.net.config import NetConfig
from p2ptrain.net.node import NetNode
from p2ptrain.node.admission import keep_revocation, kept_revocations, node_certificate
from p2ptrain.node.adoption import ChainKeeper
from p2ptrain.node.collector import BlobCollector
from p2ptrain.node.evaluator import HeadEvaluator
from p2ptrain.node.gossip_in import GossipIn, gossip_skip
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.renewal import renewal_for
from p2ptrain.node.reports import ReportKeeper
from p2ptrain.node.roles import role_runners
from p2ptrain.node.setup import NodeSettings, Prepared
from p2ptrain.node.shard_cache import ShardCache
from p2ptrain.node.status_view import StatusView
from p2ptrain.node.transport import NetTransport
from p2ptrain.observe.dashboard import Dashboard
from p2ptrain.observe.events import (
    CatchingUp,
    NodeEvent,
    Published,
    Ready,
    RoleFailure,
    Stopped,
)
from p2ptrain.observe.status import NodeStatus
from p2ptrain.observe.telemetry import NodeTelemetry
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.intake import IntakeRules
from p2ptrain.protocol.retention import pinned_blobs, unknown_grace_s
from p2ptrain.protocol.role import RoleMachine
from p2ptrain.torch.workload import Workload

__all__ = ["Node"]

logger = logging.getLogger(__name__)

#: A trainer not heard from for this many heartbeats (it announces itself every heartbeat)
#: is no longer expected to report: the open window may close without it.
PRESENCE_HEARTBEATS = 3


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
        self.settings, self.store, self._on_event = settings, store, on_event
        self.identity, self.network = prepared.identity, prepared.network
        self.peer_id = prepared.identity.peer_id
        self.manifest = manifest = prepared.experiment.record
        self.experiment_id = prepared.experiment.record_id
        self._stop = asyncio.Event()
        self.failed: LocalError | None = None
        self.failures = FailureBook(settings.max_role_failures)
        #: Counters, timings and the window history (status, /metrics, the dashboard).
        pinned = {shard.blob_id: "shard" for shard in manifest.dataset.shards}
        pinned[manifest.genesis_weights] = "state"
        self.telemetry = NodeTelemetry(settings.data_dir, pinned)
        #: Where ``--metrics-listen`` serves (once the node runs).
        self.metrics_address: str | None = None
        self.view = StatusView(self)
        intake = IntakeRules(
            manifest,
            self.experiment_id,
            max_update_bytes=max_update_bytes_any(manifest.codec, schema_of(prepared.genesis)),
        )
        storage = StorageHealth(str(store.datadir.path))
        #: Deletes the blobs the node no longer needs (None: an archive node keeps all).
        self.collector: BlobCollector | None = None
        if not settings.archive:
            self.collector = BlobCollector(
                store.blobs,
                keep_heads=settings.keep_heads,
                pinned=pinned_blobs(manifest),
                grace_s=unknown_grace_s(manifest.window),
                storage=storage,
            )
        self.dashboard = Dashboard(self.view.dashboard_snapshot)
        self.net = self._network(settings, store, self.dashboard)
        intake.revoked = self.net.gatekeeper.revoked  # revoked peers' records are refused
        self.services = PeerServices(
            net=NetTransport(self.net, store.blobs, fetch_timeout_s=settings.fetch_timeout_s),
            identity=self.identity,
            store=store,
            experiment_id=self.experiment_id,
            bootstrap=settings.bootstrap,
            keeps_records=bool({"reducer", "validator"} & set(settings.roles)),  # they serve
            emit=self._emit,
            # records fetched by a window sync pass the same intake as gossip
            admit=lambda signed: intake.judge(signed, self.height + 1),
            on_adopted=self._adopted,
            on_update=None if self.collector is None else self.collector.saw_update,
            telemetry=self.telemetry,
            storage=storage,
        )
        self.follower, self.runners = role_runners(
            settings.roles,
            prepared,
            workload,
            services=self.services,
            failures=self.failures,
            emit=self._emit,
            store=store,
            shards=shards,
            presence_timeout_s=(
                PRESENCE_HEARTBEATS * settings.heartbeat_s if settings.close_early else None
            ),
        )
        self.evaluator: HeadEvaluator | None = None
        if evaluator_workload is not None:
            self.evaluator = HeadEvaluator(
                workload=evaluator_workload,
                manifest=manifest,
                identity=self.identity,
                services=self.services,
                failures=self.failures,
                emit=self._emit,
            )
        self.reports = ReportKeeper(
            store, self.experiment_id, self.follower, self.telemetry, storage
        )
        self.keeper = ChainKeeper(
            settings=settings,
            peer_id=self.peer_id,
            store=store,
            follower=self.follower,
            runners=self.runners,
            telemetry=self.telemetry,
            reports=self.reports,
            evaluator=self.evaluator,
            collector=self.collector,
            emit=self._emit,
            wire_bytes=self.view.wire_bytes,
            write_status=self.view.write,
            stop=self.stop,
        )
        self.gossip_in = GossipIn(
            intake, self.runners, self.services, self.reports, archive=settings.archive
        )
        self.net.serve_chain(self.follower.chain)
        gossip = self.gossip_in
        self.net.gossip.subscribe(self.services.topic, gossip.deliver, gossip.check)
        #: The network once the node runs (None before).
        self.running_net: NetNode | None = None

    # -- life cycle -----------------------------------------------------------------------

    @property
    def height(self) -> int:
        """The highest certified head the node holds."""
        return self.follower.chain.height

    @property
    def stop_reason(self) -> str:
        """Why the node stopped by itself ('' while running, or stopped from outside)."""
        return self.keeper.stop_reason

    def stop(self) -> None:
        """Ask :meth:`run` to return (safe from a signal handler on the loop)."""
        self._stop.set()

    def status(self) -> NodeStatus:
        return self.view.status()

    async def run(self) -> NodeStatus:
        """Run until stopped; return the final status. Raises :class:`RoleFailed` (after
        stopping cleanly) when a role failed too many steps in a row."""
        s, net = self.settings, self.net
        torch.set_num_threads(max(1, s.threads))
        self.running_net = net
        async with net, self.view.metrics_listener(), self.dashboard:
            if s.host is not None and s.port == 0:
                self.store.remember_listen_port(net.port)
            self.keeper.restore(self.identity.public_key)
            await self.view.write_first()
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
            self.keeper.check_target(at_start=True)
            await self._run_roles()
            if self.keeper.target_reached and self.failed is None:
                await self.keeper.linger(net)
            status = self.status()
            self.view.write(status)
        failed = None if self.failed is None else str(self.failed)
        self._emit(Stopped(peer_id=self.peer_id, height=self.height, failed=failed))
        if self.failed is not None:
            raise self.failed
        return status

    def _network(self, s: NodeSettings, store: NodeStore, dashboard: Dashboard) -> NetNode:
        """The node's network presence (started by :meth:`run`) with its own answers and
        the dashboard's pages (the server's own /metrics answers loopback only)."""
        config = NetConfig(
            host=s.host,
            port=s.port,
            advertise=s.advertise,
            bootstrap=s.bootstrap,
            mdns=s.mdns,
            heartbeat_s=s.heartbeat_s,
            tls=s.tls,
            tls_dir=str(s.data_dir) if s.tls else None,
            # a restarted node keeps its address when it can (seeds above all: every
            # peer's bootstrap names it)
            preferred_port=store.listen_port() if s.host is not None else 0,
            gossip_skip=gossip_skip(s.roles),
        )
        network = self.network.record
        admission = node_certificate(network, self.identity, s.data_dir, s.roles, s.certificate)
        #: This node's certificate to a certificate network (None: the network needs none).
        self.admission = None if admission is None else admission.record
        #: Its renewal at the issuer it signed in at (None: nobody renews it).
        self.renewal = renewal_for(s.data_dir, self.identity, admission, self._renewed)
        net = NetNode(
            identity=self.identity,
            network=network,
            blobs=store.blobs,
            config=config,
            roles=s.roles,
            secret=s.secret,
            admission=admission,
            relay=s.relay,
            answers=self.view.answers(),
            on_blob_bytes=self.telemetry.blob_bytes,
            extra_routes=dashboard.routes(),
            metrics_text=self.view.metrics_text,
            on_revoked=functools.partial(self._revoked, store),
        )
        for revocation in kept_revocations(store, network):  # cut off before any connection
            net.revoke(revocation)
        return net

    def _renewed(self, certificate: Signed[AdmissionCertificate]) -> None:
        """Show the renewed ``certificate`` from the next request on."""
        self.net.client.credentials.use_admission(certificate)
        self.admission = certificate.record
        self.view.write()

    def _revoked(self, store: NodeStore, signed: Signed[Revocation]) -> None:
        """Keep a revocation; when it is this node's own, stop, saying so."""
        keep_revocation(store, signed)
        if signed.record.subject == self.identity.public_key and self.failed is None:
            issuer = peer_id_of(signed.record.issuer)[:16]
            self.failed = LocalError(
                f"this node's admission to the network was revoked by issuer {issuer} "
                f"({signed.record.reason or 'no reason given'}); its peers refuse it now. Ask "
                "the network's issuer why, and for a new certificate for a new key"
            )
            self.stop()

    async def _run_roles(self) -> None:
        """The runners and the node's own tasks, until stopped or a role failed."""
        try:
            async with asyncio.TaskGroup() as group:
                for runner in self.runners:
                    group.create_task(runner.run(), name=runner.role)
                sync = self.keeper.sync_forever(self.services, self.settings.sync_interval_s)
                group.create_task(sync, name="sync")
                group.create_task(self.view.write_forever(), name="status")
                if self.collector is not None:
                    snapshot = functools.partial(self.keeper.keep_set, self.collector)
                    group.create_task(self.collector.run(snapshot), name="collector")
                if self.evaluator is not None:
                    group.create_task(self.evaluator.run(), name="evaluator")
                if self.renewal is not None:
                    group.create_task(self.renewal.run(), name="renewal")
                await self._stop.wait()
                raise _Stopping
        except* _Stopping:
            pass
        except* RoleFailed as failures:
            first = failures.exceptions[0]
            assert isinstance(first, RoleFailed)
            self.failed = first
            logger.error("%s", first)

    def _adopted(self, machine: RoleMachine, action: act.Adopted) -> None:
        self.keeper.adopted(machine, action)

    def _emit(self, event: NodeEvent) -> None:
        self.telemetry.event(event, time.monotonic())
        if isinstance(event, Published):
            self.keeper.published[event.window] = event.update_id
        if self._on_event is not None:
            self._on_event(event)
        if isinstance(event, RoleFailure | CatchingUp):
            self.view.write()


class _Stopping(Exception):
    """Ends the node's task group when :meth:`Node.stop` was called."""
