"""The metrics reports beside the chain (:mod:`p2ptrain.protocol.metrics`): taken in from
gossip (or our own evaluator), held until their head is certified here, stored, and shown
as each head's median validation loss in the window history and the status."""

from __future__ import annotations

import logging

from p2ptrain.core.envelope import Signed
from p2ptrain.core.records import MetricsReport
from p2ptrain.driver.storage import StorageHealth
from p2ptrain.node.persist import NodeStore
from p2ptrain.observe.status import ValidationMetrics
from p2ptrain.observe.telemetry import NodeTelemetry
from p2ptrain.protocol.follower import Follower
from p2ptrain.protocol.intake import Admission
from p2ptrain.protocol.metrics import MetricsBook, median

__all__ = ["ReportKeeper"]

logger = logging.getLogger(__name__)


class ReportKeeper:
    """The reports of recent certified heads (what is stored is in the store)."""

    def __init__(
        self,
        store: NodeStore,
        experiment_id: str,
        follower: Follower,
        telemetry: NodeTelemetry,
        storage: StorageHealth,
    ) -> None:
        self.store = store
        self.experiment_id = experiment_id
        self.follower = follower
        self.telemetry = telemetry
        self.storage = storage
        self.book: MetricsBook[Signed[MetricsReport]] = MetricsBook()

    def load(self, height: int) -> None:
        """The stored reports of the heads before ``height`` the book keeps (a restart)."""
        floor = height - self.book.keep_heights
        self.book.load(self.store.metrics_reports(self.experiment_id, min_height=floor))

    def certified_at(self, height: int) -> str | None:
        link = self.follower.chain.at(height)
        return None if link is None else link.head_id

    def judge(self, report: MetricsReport) -> Admission:
        """The intake of a report that passed the envelope and record checks."""
        return self.book.judge(report, self.follower.chain.height, self.certified_at)

    def take(self, signed: Signed[MetricsReport]) -> None:
        """A report that passed intake (or our own): stored if its head is certified here,
        held until it is if it names the next height."""
        report = signed.record
        if report.height > self.follower.chain.height:
            self.book.hold(signed.record_id, report, signed)
        else:
            self.keep(signed)

    def keep(self, signed: Signed[MetricsReport]) -> None:
        report = signed.record
        if report.head_id != self.certified_at(report.height) or not self.book.add(report):
            return  # a duplicate, a full head, or a head not (or no longer) ours
        self.show(report.head_id)
        try:
            self.store.put_report(signed)
        except Exception as exc:  # a report is worth a warning, never the node
            if not self.storage.check("storing a metrics report", exc):
                logger.warning("storing the metrics report of head %d: %s", report.height, exc)
        else:
            self.storage.succeeded()

    def certified(self, height: int, head_id: str) -> None:
        """Head ``head_id`` is certified at ``height`` here: the reports that came before
        it are shown and those held for it kept."""
        self.show(head_id)
        for waiting in self.book.certified(height, head_id):
            self.keep(waiting)

    def show(self, head_id: str) -> None:
        """The window history shows the median of the reports kept for ``head_id``."""
        losses = self.book.losses(head_id)
        if (loss := median(losses)) is not None:
            self.telemetry.history.set_validation(head_id, loss, len(losses))

    def evaluators_of(self, head_id: str) -> set[bytes]:
        return {r.evaluator for r in self.store.reports_for(head_id)}

    def validation(self) -> ValidationMetrics | None:
        latest = self.book.latest()
        if latest is None:
            return None
        return ValidationMetrics(
            height=latest.height,
            head_id=latest.head_id,
            median_loss=latest.median_loss,
            reports=latest.reports,
        )
