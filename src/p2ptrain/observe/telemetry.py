"""A node's training figures: counters, phase timings, bytes by kind, and ``/metrics``.

:class:`NodeTelemetry` is told what happens as it happens -- by the shell (updates seen on
the topic, heads certified, role errors), the runners (fetches, what they publish, what
arrives) and the network (blob bytes served and pushed) -- and keeps:

* **counters**, all derived from the verified chain so every node counts the same windows
  the same way: windows certified, updates accepted and rejected (by the quarantine book's
  reason), and windows that failed here (by reason: ``deadline`` -- the window passed its
  deadline without a certificate and the node asked its peers what it held; ``role_error``
  -- a step of one of the node's roles raised in that window);
* **bytes sent and received by kind** (``update``, ``aggregate``, ``state``, ``shard``, and
  ``other`` for blobs it cannot name; ``gossip`` comes from the network's own counters);
* **phase durations** (:data:`PHASES`) as a ``prometheus_client`` histogram, and per window
  in the :class:`~.window_history.WindowHistory`:

  ========  ====================================================================
  wait      from the window's opening here until its first proposal was seen (the
            window waiting for its updates and deadline; see the status's waiting line)
  train     a trainer's inner steps for the window
  publish   from the end of training until the update went out (push + gossip)
  fetch     one blob download (an update, a head's state or aggregate)
  reduce    from the last update's arrival until this reducer's proposal went out
  attest    from the first proposal's arrival until this validator's attestation
  certify   from the first attestation seen until this node adopted the head
  ========  ====================================================================

:func:`node_families` turns a :class:`~.status.NodeStatus` (which carries the counters)
into typed Prometheus families, so ``/metrics`` and ``p2ptrain status --json`` say the
same thing when read together.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.reasons import Reason
from p2ptrain.core.records import Head, Proposal, Update
from p2ptrain.net.net_metrics import PREFIX
from p2ptrain.observe.events import NodeEvent, Published, RoleFailure, Trained
from p2ptrain.observe.status import NodeStatus
from p2ptrain.observe.window_history import (
    SeenUpdate,
    WindowHistory,
    reason_label,
    rejections,
    window_record,
)

__all__ = ["BYTE_KINDS", "PHASES", "NodeTelemetry", "node_families"]

PHASES = ("wait", "train", "publish", "fetch", "reduce", "attest", "certify")
BYTE_KINDS = ("update", "aggregate", "state", "shard", "gossip", "other")
_PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, float("inf"))
#: Blob ids whose kind the node remembers (for the bytes it serves), and updates seen.
_KNOWN_BLOBS = 8192
_SEEN_UPDATES = 4096
#: Windows behind the newest for which marks are kept.
_MARK_WINDOWS = 8
#: Proposals whose rejections are kept until their window is certified.
_PROPOSALS = 64


class NodeTelemetry:
    """See the module docstring. ``data_dir``: where the window history is kept (None:
    in memory only); ``pinned``: the kinds of the blobs a node always holds (genesis, the
    dataset's shards), known for good."""

    def __init__(
        self, data_dir: Path | None = None, pinned: Mapping[str, str] | None = None
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.phase_seconds = Histogram(
            PREFIX + "phase_seconds",
            "Seconds a window phase took on this node (wait, train, publish, fetch, reduce, "
            "attest, certify)",
            ["phase"],
            registry=self.registry,
            buckets=_PHASE_BUCKETS,
        )
        self.history = WindowHistory(data_dir)
        self.windows_certified = 0
        self.updates_accepted = 0
        self.updates_rejected: dict[str, int] = {}
        self.windows_failed: dict[str, int] = {}
        self.sent: dict[str, int] = dict.fromkeys(BYTE_KINDS, 0)
        self.received: dict[str, int] = dict.fromkeys(BYTE_KINDS, 0)
        self._pinned = dict(pinned or {})
        self._kinds: OrderedDict[str, str] = OrderedDict()
        self._seen: OrderedDict[str, SeenUpdate] = OrderedDict()
        #: window -> mark -> monotonic time (first proposal, last update, ...).
        self._marks: dict[int, dict[str, float]] = {}
        #: window -> phase -> seconds, until the window's record is written.
        self._phases: dict[int, dict[str, float]] = {}
        self._failed: set[tuple[int, str]] = set()
        #: head id -> (window, rejections) of the proposals seen for open windows.
        self._proposed: dict[str, tuple[int, dict[str, Reason]]] = {}
        self._open_window = 1
        self._adopted_at = time.monotonic()
        self._wire_at_adoption = (0, 0)

    # -- blobs and bytes ------------------------------------------------------------------

    def blob_kind(self, blob_id: str, kind: str) -> None:
        """Remember what ``blob_id`` is (for the bytes it moves later)."""
        self._kinds[blob_id] = kind
        self._kinds.move_to_end(blob_id)
        while len(self._kinds) > _KNOWN_BLOBS:
            self._kinds.popitem(last=False)

    def blob_bytes(self, direction: str, blob_id: str, n: int) -> None:
        """``n`` bytes of blob ``blob_id`` went out (``sent``) or came in (``received``)."""
        kind = self._kinds.get(blob_id) or self._pinned.get(blob_id, "other")
        self.count_bytes(direction, kind, n)

    def count_bytes(self, direction: str, kind: str, n: int) -> None:
        table = self.sent if direction == "sent" else self.received
        key = kind if kind in table else "other"
        table[key] += max(0, n)

    def fetched(self, blob_id: str, kind: str, seconds: float) -> None:
        """A blob download finished: the fetch phase of the open window (its bytes are
        counted as they land, :meth:`count_bytes`)."""
        self.blob_kind(blob_id, kind)
        self.phase(self._open_window, "fetch", seconds, longest=True)

    # -- what happens in a window ---------------------------------------------------------

    def phase(self, window: int, name: str, seconds: float, *, longest: bool = False) -> None:
        """``name`` took ``seconds`` in ``window`` (``longest``: of several in the window,
        e.g. concurrent downloads, its record keeps the longest)."""
        self.phase_seconds.labels(name).observe(max(0.0, seconds))
        phases = self._phases.setdefault(window, {})
        phases[name] = max(phases.get(name, 0.0), seconds) if longest else seconds

    def mark(self, window: int, what: str, now: float, *, first: bool = True) -> None:
        marks = self._marks.setdefault(window, {})
        if not first or what not in marks:
            marks[what] = now

    def marked(self, window: int, what: str) -> float | None:
        return self._marks.get(window, {}).get(what)

    def saw_update(self, update_id: str, update: Update, now: float) -> None:
        """A signed update passed intake (or is our own)."""
        if update_id not in self._seen:
            self._seen[update_id] = SeenUpdate(
                update_id=update_id,
                window=update.window,
                trainer=peer_id_of(update.trainer),
                loss_before=update.loss_before,
                loss_after=update.loss_after,
            )
            while len(self._seen) > _SEEN_UPDATES:
                self._seen.popitem(last=False)
        self.blob_kind(update.delta_blob, "update")
        self.mark(update.window, "last_update", now, first=False)

    def saw_proposal(self, proposal: Proposal, now: float) -> None:
        """A signed proposal passed intake (or is our own): its rejections say why each
        update it left out was rejected, should its head be certified."""
        self.mark(proposal.window, "proposal", now)
        if len(self._proposed) < _PROPOSALS:
            self._proposed[proposal.head.id] = (
                proposal.window,
                {r.update_id: r.reason for r in proposal.rejected},
            )

    def saw_attestation(self, height: int, now: float) -> None:
        self.mark(height, "attestation", now)

    def proposed(self, window: int, now: float) -> None:
        """This reducer's proposal went out."""
        since = self.marked(window, "last_update")
        self.phase(window, "reduce", now - (self._adopted_at if since is None else since))
        self.mark(window, "proposal", now)

    def attested(self, height: int, now: float) -> None:
        """This validator's attestation went out."""
        since = self.marked(height, "proposal")
        self.phase(height, "attest", now - (self._adopted_at if since is None else since))
        self.saw_attestation(height, now)

    def event(self, event: NodeEvent, now: float) -> None:
        """What the node's roles said that the phases count: a window trained, an update
        published, a role's step that failed."""
        if isinstance(event, Trained):
            self.trained(event.window, event.inner_seconds or event.seconds, now)
        elif isinstance(event, Published):
            self.published(event.window, now)
        elif isinstance(event, RoleFailure):
            self.window_failed(event.window, "role_error")

    def trained(self, window: int, inner_seconds: float, now: float) -> None:
        self.phase(window, "train", inner_seconds)
        self.mark(window, "trained", now, first=False)

    def published(self, window: int, now: float) -> None:
        """This trainer's update went out."""
        since = self.marked(window, "trained")
        if since is not None:
            self.phase(window, "publish", now - since)

    def window_failed(self, window: int, reason: str) -> None:
        """Window ``window`` failed here for ``reason`` (counted once per window)."""
        if (window, reason) in self._failed:
            return
        self._failed.add((window, reason))
        self.windows_failed[reason] = self.windows_failed.get(reason, 0) + 1

    # -- certified heads ------------------------------------------------------------------

    def count_head(
        self, head: Head, parent: Head | None, rejected: Mapping[str, Reason] | None = None
    ) -> None:
        """Count a certified head (stored or new): its accepted updates and rejections, by
        reason (``rejected``: its proposal's, when seen; else the quarantine book's)."""
        self.windows_certified += 1
        self.updates_accepted += len(head.accepted)
        if rejected is None:
            rejected = {e.peer_id: e.reason for e in rejections(head, parent)}
        for reason in rejected.values():
            label = reason_label(reason)
            self.updates_rejected[label] = self.updates_rejected.get(label, 0) + 1

    def certified(
        self,
        head: Head,
        head_id: str,
        parent: Head | None,
        certificate: QuorumCertificate,
        *,
        reason: str,
        wire: tuple[int, int],
        now: float,
    ) -> None:
        """This node adopted certified ``head`` (``wire``: its total bytes sent and
        received so far): count it, time it, and write its window's record."""
        proposed = self._proposed.pop(head_id, None)
        rejected = None if proposed is None else proposed[1]
        self.count_head(head, parent, rejected)
        for blob in (head.weights_blob, head.optimizer_blob):
            if blob is not None:
                self.blob_kind(blob, "state")
        if head.aggregate_blob is not None:
            self.blob_kind(head.aggregate_blob, "aggregate")
        window = head.height
        closed = self.marked(window, "proposal") or self.marked(window, "attestation") or now
        if closed >= self._adopted_at:
            self.phase(window, "wait", closed - self._adopted_at)
        first_vote = self.marked(window, "attestation")
        if first_vote is not None:
            self.phase(window, "certify", now - first_vote)
        sent, received = wire
        self.history.add(
            window_record(
                head,
                head_id,
                parent,
                certificate,
                self._seen,
                certified_at=time.time(),
                seconds=now - self._adopted_at,
                reason=reason,
                phases=self._phases.pop(window, {}),
                bytes_sent=max(0, sent - self._wire_at_adoption[0]),
                bytes_received=max(0, received - self._wire_at_adoption[1]),
                rejected=rejected,
            )
        )
        self._adopted_at, self._wire_at_adoption = now, wire
        self._open_window = window + 1
        floor = window - _MARK_WINDOWS
        for table in (self._marks, self._phases):
            for old in [w for w in table if w < floor]:
                del table[old]
        self._failed = {(w, r) for w, r in self._failed if w >= floor}
        self._proposed = {h: p for h, p in self._proposed.items() if p[0] > window}


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, help_text, value=value)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_text, value=value)


def _labelled(
    family: CounterMetricFamily | GaugeMetricFamily, values: dict[str, int]
) -> CounterMetricFamily | GaugeMetricFamily:
    for label, value in sorted(values.items()):
        family.add_metric([label], value)
    return family


def node_families(status: NodeStatus) -> Iterator[Metric]:
    """The training figures of one status snapshot, typed."""
    if status.aggregation_backend is not None:
        yield InfoMetricFamily(
            PREFIX + "aggregation",
            "The aggregation backend in use: the native kernel (packaged in the wheel, or "
            "built on first use) or torch",
            value={"backend": status.aggregation_backend},
        )
    reduction = GaugeMetricFamily(
        PREFIX + "reduction_seconds",
        "Wall seconds this reducer or validator took to reduce its last window (its own "
        "cohort, or a proposal's recomputed)",
    )
    reduced = GaugeMetricFamily(
        PREFIX + "reduction_window", "The window the last reduction's seconds are of"
    )
    if status.reduction_seconds is not None and status.reduction_window is not None:
        reduction.add_metric([], status.reduction_seconds)
        reduced.add_metric([], status.reduction_window)
    yield reduction
    yield reduced
    yield _gauge("height", "Height of the highest certified head this node holds", status.height)
    yield _counter(
        "windows_certified",
        "Certified windows in this node's verified chain",
        status.windows_certified,
    )
    yield _labelled(
        CounterMetricFamily(
            PREFIX + "windows_failed",
            "Windows that failed on this node, by reason (deadline: no certificate by the "
            "deadline; role_error: a role's step raised)",
            labels=["reason"],
        ),
        status.windows_failed,
    )
    yield _counter(
        "updates_accepted",
        "Updates accepted into certified heads of this node's chain",
        status.updates_accepted,
    )
    yield _labelled(
        CounterMetricFamily(
            PREFIX + "updates_rejected",
            "Updates rejected by the certified heads' quarantine book, by reason",
            labels=["reason"],
        ),
        status.updates_rejected,
    )
    yield _gauge(
        "quarantined_peers",
        "Peers quarantined by the certified head for the next window",
        status.quarantined_peers,
    )
    for direction in ("sent", "received"):
        yield _labelled(
            CounterMetricFamily(
                PREFIX + f"bytes_{direction}",
                f"Bytes this node {direction}, by kind (update, aggregate, state, shard, "
                "gossip, other)",
                labels=["kind"],
            ),
            status.bytes_sent_by_kind if direction == "sent" else status.bytes_received_by_kind,
        )
    yield _counter(
        "wire_bytes_sent",
        "TCP payload bytes this node's connections sent (all kinds)",
        status.bytes_sent,
    )
    yield _counter(
        "wire_bytes_received",
        "TCP payload bytes this node's connections received (all kinds)",
        status.bytes_received,
    )
    yield _gauge("peers", "Peers this node knows", status.peers)
    yield _gauge("banned_peers", "Peers this node bans now", status.banned)
    connections = GaugeMetricFamily(
        PREFIX + "connections", "Gossip connections open now", labels=["direction"]
    )
    connections.add_metric(["outbound"], status.connections.outbound)
    connections.add_metric(["inbound"], status.connections.inbound)
    yield connections
    yield _gauge("store_bytes", "Bytes of blobs in this node's store", status.store_bytes)
    yield _gauge("store_blobs", "Blobs in this node's store", status.store_blobs)
    yield _counter(
        "blobs_collected", "Blobs this node deleted as no longer needed", status.blobs_collected
    )
    yield _counter("role_errors", "Steps of this node's roles that raised", status.role_errors)
    trainer = status.trainer
    utilisation = GaugeMetricFamily(
        PREFIX + "compute_utilisation",
        "A trainer's seconds in inner steps over the wall seconds since its first step",
    )
    train_loss = GaugeMetricFamily(
        PREFIX + "train_loss", "A trainer's loss after the inner steps of its last window"
    )
    if trainer is not None:
        if trainer.compute_utilisation is not None:
            utilisation.add_metric([], trainer.compute_utilisation)
        train_loss.add_metric([], trainer.loss_after)
    yield utilisation
    yield train_loss
    validation = GaugeMetricFamily(
        PREFIX + "validation_loss",
        "Evaluators' median validation loss of the latest certified head they reported on",
    )
    validated = GaugeMetricFamily(
        PREFIX + "validation_height", "Height of the head the validation loss is of"
    )
    if status.validation is not None:
        validation.add_metric([], status.validation.median_loss)
        validated.add_metric([], status.validation.height)
    yield validation
    yield validated
