"""Gossip into a node: the topic validator, then the message to the roles that use it.

Every message is checked against the experiment's intake rules before anything is kept or
forwarded (:mod:`p2ptrain.protocol.intake`; a certified head by its certificate, a metrics
report by the report book). One that passed is counted (the window history), kept when the
node is an archive, and handed on: a certified head to the node's first runner (it hands
it to the follower every role shares), a record to every runner but the role that
published it (our own records come back through gossip after the effects under way), a
metrics report to the report keeper.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from p2ptrain.core.certificate import CertifiedLink
from p2ptrain.core.records import Attestation, MetricsReport, Proposal, Update
from p2ptrain.driver.runner import RoleRunner
from p2ptrain.driver.services import PeerServices
from p2ptrain.net.gossip import CERTIFICATE_KIND, Delivered, Refusal
from p2ptrain.node.persist import METRICS_KIND
from p2ptrain.node.reports import ReportKeeper
from p2ptrain.protocol.intake import IntakeRules

__all__ = ["GossipIn", "gossip_skip"]

_EXPERIMENT_KINDS = ("update", "proposal", "attestation", METRICS_KIND, CERTIFICATE_KIND)
#: What a node that only trains has no use for: the window's consensus traffic. It follows
#: heads by their certificates; its own updates go out to the neighbours that take them
#: (every seed it dials does), and whether a proposal named one it learns from the next
#: head (a trainer whose window is still open at its deadline sends its update again).
_TRAINER_SKIPS = ("attestation", "proposal", "update")


def gossip_skip(roles: Sequence[str]) -> tuple[str, ...]:
    """The gossip kinds a node of ``roles`` asks its neighbours not to send it."""
    return _TRAINER_SKIPS if set(roles) == {"trainer"} else ()


class GossipIn:
    """The node's subscription to its experiment's topic."""

    def __init__(
        self,
        intake: IntakeRules,
        runners: Sequence[RoleRunner],
        services: PeerServices,
        reports: ReportKeeper,
        *,
        archive: bool,
    ) -> None:
        """``archive``: keep every update and proposal (an archive node)."""
        self.intake = intake
        self.follower = follower = reports.follower
        self.manifest = follower.manifest
        self.experiment_id = follower.experiment_id
        self.runners = runners
        self.services = services
        self.reports = reports
        self.store = services.store
        self.archive = archive

    def check(self, message: Delivered) -> str | Refusal | None:
        """The topic validator, before anything is kept or forwarded: None to accept, else
        why not and whom it counts against (:mod:`p2ptrain.protocol.intake`)."""
        if message.kind not in _EXPERIMENT_KINDS:
            return f"{message.kind!r} does not travel on an experiment topic"
        record = message.record
        if isinstance(record, CertifiedLink):
            held = self.follower.chain.at(record.head.height)
            if held is not None and held.head_id == record.certificate.head_id:
                # another quorum's certificate of a head we hold certified: it tells nobody
                # anything, so it goes no further (a node lacking the head got ours)
                return Refusal("this head is certified here already")
            verdict = record.check(self.manifest, self.experiment_id)
            return None if verdict else f"bad certificate: {verdict.reason}"
        admission = self.intake.judge(record, self.follower.chain.height + 1)
        if admission.accepted and isinstance(record.record, MetricsReport):
            admission = self.reports.judge(record.record)
        return None if admission.accepted else Refusal(admission.reason, admission.blame)

    def deliver(self, message: Delivered) -> None:
        record = message.record
        if isinstance(record, CertifiedLink):
            runners: Sequence[RoleRunner] = self.runners[:1]  # the follower's, for every role
        elif isinstance(record.record, MetricsReport):
            self.reports.take(record)
            return  # beside the chain: no role machine has a use for it
        else:
            self._count(message)
            runners = self.runners
        origin = self.services.published_by(message)  # it holds its own record already
        for runner in runners:
            if runner.role != origin:
                runner.receive(message)

    def _count(self, message: Delivered) -> None:
        record, now = message.record, time.monotonic()
        assert not isinstance(record, CertifiedLink)
        inner, telemetry = record.record, self.services.telemetry
        if isinstance(inner, Update):
            self.services.on_update(inner)  # its blob is that window's
            telemetry.saw_update(record.record_id, inner, now)
        elif isinstance(inner, Proposal):
            telemetry.saw_proposal(inner, now)
        elif isinstance(inner, Attestation):
            telemetry.saw_attestation(inner.height, now)
        if self.archive and isinstance(inner, Update | Proposal):
            self.store.put_signed(
                record.record_id,
                message.kind,
                bytes(record.envelope.encode()),
                self.experiment_id,
                inner.window,
            )
