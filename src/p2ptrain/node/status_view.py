"""What a running node shows of itself: its status record (``status.json``,
``/v1/status``, ``p2ptrain status``), ``/metrics``, the dashboard's snapshot, and the small
HTTP answers peers ask of it (``/v1/records/``, ``/v1/window/``, ``/v1/network``).

A view of the :class:`~.shell.Node` (it reads the node's parts, never changes them); the
figures themselves are kept where they happen (:mod:`p2ptrain.observe.telemetry`, the
follower, the collector, the chain keeper).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from p2ptrain.core.encoding import encode
from p2ptrain.core.envelope import Signed
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.records import AdmissionCertificate, Revocation
from p2ptrain.driver.participant_runner import ParticipantRunner
from p2ptrain.errors import LocalError
from p2ptrain.net.client import MAX_WINDOW_IDS, WindowRecords
from p2ptrain.net.content import Answer, text_answer
from p2ptrain.net.net_metrics import exposition
from p2ptrain.net.wire_meter import loop_meter
from p2ptrain.node.collector import CollectorStatistics
from p2ptrain.node.renewal import CertificateRenewal
from p2ptrain.node.trainer_runner import TrainerRunner
from p2ptrain.observe.dashboard import Snapshot, start_listener, write_peers
from p2ptrain.observe.memory import peak_rss_mib, rss_after_imports_mib
from p2ptrain.observe.status import (
    STATUS_FILE,
    Admission,
    Connections,
    NodeStatus,
    OpenWindow,
    RevokedPeer,
    encode_status,
)
from p2ptrain.observe.telemetry import node_families
from p2ptrain.observe.window_history import PeerView
from p2ptrain.store.atomic import overwrite_in_place, write_atomically
from p2ptrain.store.kernel_build import backend

if TYPE_CHECKING:
    from p2ptrain.node.shell import Node

__all__ = ["StatusView"]

logger = logging.getLogger(__name__)

#: The status file is padded to whole pages of this size (rewritten in place on a full disk).
_STATUS_PAGE = 4096
_STATUS_EVERY_S = 2.0


class StatusView:
    """The status, metrics and answers of ``node``."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._wire_high = (0, 0)

    def answers(self) -> dict[str, Callable[[str], Answer]]:
        """The HTTP answers the node's server gives besides blobs and gossip."""
        return {
            "/v1/records/": self._answer_record,
            "/v1/window/": self._answer_window,
            "/v1/status": self._answer_status,
            "/v1/network": self._answer_network,
        }

    def wire_bytes(self) -> tuple[int, int]:
        """Bytes the node's connections sent and received: TCP payload as the kernel
        counted it, or where it cannot, what the node pushed and gossiped and the uploads
        it took in. Never less than an earlier answer (a closing connection is counted
        once its counters are read)."""
        meter, net = loop_meter(), self.node.running_net
        if meter is not None:
            sent, received = meter.totals()
        elif net is None:
            sent = received = 0
        else:
            n = net.statistics()
            sent = net.client.bytes_pushed + n.gossip.bytes_sent
            received = 0 if n.server is None else n.server.bytes_received
        high = self._wire_high
        self._wire_high = (max(high[0], sent), max(high[1], received))
        return self._wire_high

    def status(self) -> NodeStatus:
        node = self.node
        net, follower, keeper = node.running_net, node.follower, node.keeper
        tip = follower.chain.tip
        peers = banned = 0
        connections = Connections()
        bytes_sent, bytes_received = self.wire_bytes()
        telemetry = node.telemetry
        sent, received = dict(telemetry.sent), dict(telemetry.received)
        if net is not None:
            n = net.statistics()
            peers, banned = n.peers.peers, n.peers.banned
            connections = Connections(outbound=n.outbound, inbound=n.inbound)
            sent["gossip"] += n.gossip.bytes_sent
            received["gossip"] += n.gossip_bytes_received
        runners = node.runners
        reasons = [r.reason() for r in runners]
        trained = next((r.last_trained for r in runners if r.last_trained), None)
        data = next(
            (d for r in runners if isinstance(r, TrainerRunner) and (d := r.data_status())),
            None,
        )
        usage = node.store.blobs.usage()
        collector = node.collector
        collected = CollectorStatistics() if collector is None else collector.statistics()
        services, failures, evaluator = node.services, node.failures, node.evaluator
        timing = next(
            (r.machine.last_reduction for r in runners if isinstance(r, ParticipantRunner)), None
        )
        after_imports = rss_after_imports_mib()
        return NodeStatus(
            admission=_admission(node.admission, node.renewal),
            revoked=() if net is None else _revoked(net.revocations.values()),
            peer_id=node.peer_id,
            roles=tuple(node.settings.roles),
            address=None if net is None else net.address,
            experiment_id=node.experiment_id,
            height=tip.head.height,
            head_id=tip.head_id,
            adopted_head_id=follower.base.head_id,
            peers=peers,
            banned=banned,
            connections=connections,
            last_window=keeper.last_window,
            # what the open window is doing or why it has no head yet
            open_window=OpenWindow(window=tip.head.height + 1, reason="; ".join(reasons)),
            role_states=tuple(r.state() for r in runners)
            + (() if evaluator is None else (evaluator.state(),)),
            errors=tuple(failures.recent),
            failed=None if node.failed is None else str(node.failed),
            reports=tuple(services.reports),
            trainer=trained,
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
            wire_measured=loop_meter() is not None,
            pid=os.getpid(),
            aggregation_backend=backend(),
            storage=services.storage.problem,
            store_blobs=usage.blobs,
            store_bytes=usage.bytes,
            blobs_collected=collected.blobs_collected,
            bytes_collected=collected.bytes_collected,
            collect_failures=collected.failures,
            keep_heads=None if collector is None else collector.keep_heads,
            validation=node.reports.validation(),
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
            role_errors=failures.total,
            metrics_address=node.metrics_address,
            chains=1,
            heads_adopted=keeper.heads_adopted,
            outer_steps=follower.outer_steps,
            certificate_checks=follower.chain.certificate_checks,
            peak_rss_mib=round(peak_rss_mib(), 1),
            rss_after_imports_mib=None if after_imports is None else round(after_imports, 1),
            reduction_window=None if timing is None else timing.window,
            reduction_seconds=None if timing is None else round(timing.seconds, 4),
            reduction_accepted=None if timing is None else timing.accepted,
            reductions_timed=0 if timing is None else timing.count,
            reduction_seconds_total=0.0 if timing is None else round(timing.total_seconds, 4),
        )

    def write(self, status: NodeStatus | None = None) -> None:
        """Replace the status file; on a full disk, overwrite it in place (its blocks are
        held already: the file is padded to whole pages), so the status still says why."""
        node = self.node
        storage = node.services.storage
        status = self.status() if status is None else status
        try:
            node.telemetry.history.save()
            write_peers(node.settings.data_dir, self.peer_views())
        except (LocalError, OSError) as exc:
            if not storage.check("writing the window history", exc):
                logger.warning("%s", exc)
        path = node.settings.data_dir / STATUS_FILE
        data = encode_status(status)
        data += b" " * (-len(data) % _STATUS_PAGE)
        try:
            write_atomically(path, data, durable=False)  # a report, rewritten every 2 s
        except LocalError as exc:
            if not storage.check("writing the status", exc):
                logger.warning("%s", exc)
            try:
                overwrite_in_place(path, data)
            except OSError as again:
                logger.debug("status %s: %s", path, again)
        else:
            storage.succeeded()

    def metrics_text(self) -> bytes:
        """``/metrics``: the training figures of one status snapshot, the network's own,
        and the phase histograms."""
        status, net = self.status(), self.node.running_net

        def families() -> list[Metric]:
            return [*node_families(status), *([] if net is None else net.metric_families())]

        return exposition(families, self.node.telemetry.registry)

    def dashboard_snapshot(self) -> Snapshot:
        return Snapshot(
            status=self.status(),
            peers=self.peer_views(),
            windows=self.node.telemetry.history.records(),
        )

    def peer_views(self) -> tuple[PeerView, ...]:
        net = self.node.running_net
        if net is None:
            return ()
        now = time.monotonic()
        connected = net.gossip.connections
        known = tuple(
            PeerView(
                peer_id=signed.record.peer_id,
                roles=tuple(signed.record.roles),
                connected=signed.record.peer_id in connected,
                banned=net.peers.banned(signed.record.peer_id, now),
                address=signed.record.addresses[0] if signed.record.addresses else None,
                subject=_subject(net.gatekeeper.certificate_of(signed.record.public_key)),
            )
            for signed in net.peers
        )
        # revoked peers are forgotten by the peer book; the graph still shows them, crossed
        revoked = tuple(
            PeerView(
                peer_id=peer_id_of(key),
                roles=(),
                connected=False,
                banned=True,
                address=None,
                subject=_subject(net.gatekeeper.certificate_of(key)),
                revoked=True,
            )
            for key in sorted(net.gatekeeper.revoked)
        )
        return known + revoked

    async def write_first(self) -> None:
        """Write the status before the node says it is ready, so that whoever saw it ready
        finds its status file (the blob store counted off the loop, once)."""
        try:
            await asyncio.to_thread(self.node.store.blobs.usage)
        except OSError as exc:  # counted again when the status asks
            logger.warning("counting the blob store: %s", exc)
        self._write_guarded()

    async def write_forever(self) -> None:
        while True:
            await asyncio.sleep(_STATUS_EVERY_S)
            self._write_guarded()

    def _write_guarded(self) -> None:
        try:
            self.write()
        except Exception:  # the status is for people: never the end of the node
            logger.exception("writing the status failed")

    @contextlib.asynccontextmanager
    async def metrics_listener(self) -> AsyncIterator[None]:
        """``--metrics-listen``: ``/metrics`` and the dashboard on a listener of their own
        (no credentials asked: the operator chose who can reach it)."""
        where = self.node.settings.metrics_listen
        if where is None:
            yield
            return
        listener = await start_listener(where, self.dashboard_snapshot, self.metrics_text)
        self.node.metrics_address = listener.address
        try:
            yield
        finally:
            await listener.stop()

    # -- answers --------------------------------------------------------------------------

    def _answer_status(self, target: str) -> Answer:
        body = encode_status(self.status())
        return Answer(200, {"Content-Type": "application/json"}, body)

    def _answer_record(self, target: str) -> Answer:
        record_id = target.split("?", maxsplit=1)[0].rsplit("/", 1)[-1]
        raw = self.node.store.record(record_id) if len(record_id) == 64 else None
        if raw is None:
            return text_answer(404, f"this node does not hold record {record_id[:64]}")
        return Answer(200, {"Content-Type": "application/msgpack"}, raw)

    def _answer_window(self, target: str) -> Answer:
        """``/v1/window/{experiment}/{window}``: the ids of the window's updates and
        proposals kept here (a peer whose window is stuck fetches those it lacks)."""
        experiment_id = self.node.experiment_id
        parts = target.split("?", maxsplit=1)[0].split("/")
        if len(parts) != 5 or parts[3] != experiment_id or not parts[4].isdigit():
            return text_answer(404, "ask /v1/window/{experiment}/{window} of our experiment")
        held = self.node.store.window_record_ids(experiment_id, int(parts[4]), MAX_WINDOW_IDS // 2)
        body = encode(WindowRecords(updates=held["update"], proposals=held["proposal"]))
        return Answer(200, {"Content-Type": "application/msgpack"}, body)

    def _answer_network(self, target: str) -> Answer:
        body = bytes(self.node.network.envelope.encode())
        return Answer(200, {"Content-Type": "application/msgpack"}, body)


def _admission(
    certificate: AdmissionCertificate | None, renewal: CertificateRenewal | None
) -> Admission | None:
    if certificate is None:
        return None
    return Admission(
        issuer=peer_id_of(certificate.issuer),
        roles=certificate.roles,
        not_after_ms=certificate.not_after_ms,
        name=certificate.name,
        renews_at="" if renewal is None else renewal.issuer_url,
        renewed=0 if renewal is None else renewal.renewed,
        renewal_problem="" if renewal is None else renewal.problem,
    )


def _revoked(revocations: Iterable[Signed[Revocation]]) -> tuple[RevokedPeer, ...]:
    return tuple(
        RevokedPeer(
            peer_id=peer_id_of(r.record.subject),
            issuer=peer_id_of(r.record.issuer),
            reason=r.record.reason,
        )
        for r in revocations
    )


def _subject(certificate: AdmissionCertificate | None) -> str:
    return "" if certificate is None else certificate.name
