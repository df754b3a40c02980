"""A node's status as one frozen record: what ``p2ptrain status`` shows and the node writes.

The node writes its :class:`NodeStatus` to ``status.json`` in its data directory (before it
says it is ready, every two seconds, at each certified window and when it stops) and answers
it at ``GET /v1/status``; :func:`read_status` and :func:`decode_status` read either back into
the record.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from p2ptrain.errors import LocalError

__all__ = [
    "STATUS_FILE",
    "Admission",
    "Connections",
    "LastWindow",
    "NodeStatus",
    "OpenWindow",
    "PeerReport",
    "RevokedPeer",
    "RoleError",
    "RoleState",
    "StorageProblem",
    "TrainerWindow",
    "ValidationMetrics",
    "decode_status",
    "encode_status",
    "mean_bytes_by_kind",
    "read_status",
]

STATUS_FILE = "status.json"


class _Record(msgspec.Struct, frozen=True, kw_only=True):
    pass


class Connections(_Record, frozen=True):
    outbound: int = 0
    inbound: int = 0


class LastWindow(_Record, frozen=True):
    """The last window this node saw certified."""

    height: int
    head_id: str
    accepted: int
    quarantined: int
    reason: str
    seconds: float


class OpenWindow(_Record, frozen=True):
    """The window after the node's head, and what its roles are doing about it."""

    window: int
    reason: str | None


class TrainerWindow(_Record, frozen=True):
    """The trainer's last trained window."""

    window: int
    loss_before: float
    loss_after: float
    seconds: float
    blob_bytes: int
    #: Seconds in inner steps over the wall seconds from the first to the last (None before
    #: a window finished; 1.0: the trainer never waited).
    compute_utilisation: float | None = None


class ValidationMetrics(_Record, frozen=True):
    """The latest certified head evaluators reported on: the median of their validation
    losses and how many reports there are."""

    height: int
    head_id: str
    median_loss: float
    reports: int


class RoleError(_Record, frozen=True):
    """An unexpected exception in a step of a role: which role, window and step, and what."""

    role: str
    window: int
    step: str
    error: str  # the exception's type
    message: str
    at: float  # unix time

    def describe(self) -> str:
        return f"window {self.window}, {self.step}: {self.error}: {self.message}"


class RoleState(_Record, frozen=True):
    """One role of the node: what it is doing and how many of its steps failed in a row."""

    role: str
    last_reason: str
    failures_in_a_row: int
    statistics: dict[str, Any]


class PeerReport(_Record, frozen=True):
    peer: str
    reason: str


class StorageProblem(_Record, frozen=True):
    """Writes to local storage fail (a full or read-only disk): where, and what to do."""

    path: str
    message: str
    since: float  # unix time of the first failure
    failures: int


class DataStatus(_Record, frozen=True):
    """A trainer's training data, for ``p2ptrain status``: what it is and where it lives;
    for prepared shards also what the node holds and what it downloaded."""

    kind: str
    descriptor: str
    location: str | None = None
    #: Shards held on this machine, and their bytes (prepared shards only).
    shards_held: int = 0
    bytes_held: int = 0
    #: The most shard bytes kept (None: no bound).
    cache_limit_bytes: int | None = None
    #: Shards fetched from peers since the node started, and the bytes that came in for them.
    fetched_shards: int = 0
    downloaded_bytes: int = 0
    #: Distinct shards this node's leases named since it started, and their size.
    leased_shards: int = 0
    leased_bytes: int = 0
    evicted_shards: int = 0


class RevokedPeer(_Record, frozen=True):
    """A peer whose admission an issuer revoked (this node refuses it)."""

    peer_id: str
    issuer: str
    reason: str


class Admission(_Record, frozen=True):
    """This node's own certificate to a certificate network."""

    issuer: str
    #: The roles it allows (empty: any).
    roles: tuple[str, ...]
    #: Its expiry, Unix milliseconds (0: none).
    not_after_ms: int
    #: Who the issuer checked the key belongs to ("" when it did not say).
    name: str
    #: Where the node renews it ("" when nobody does: it does not expire, or came from
    #: ``p2ptrain admit``), how many times it did since it started, and why the last
    #: renewal failed ("" when it did not).
    renews_at: str = ""
    renewed: int = 0
    renewal_problem: str = ""


class NodeStatus(_Record, frozen=True):
    peer_id: str
    roles: tuple[str, ...]
    address: str | None
    experiment_id: str
    #: The highest certified head the node holds (``head_id``) and the one its roles build
    #: on (``adopted_head_id``: they differ while its weights are being fetched).
    height: int
    head_id: str
    adopted_head_id: str
    peers: int = 0
    banned: int = 0
    connections: Connections = Connections()
    last_window: LastWindow | None = None
    open_window: OpenWindow | None = None
    role_states: tuple[RoleState, ...] = ()
    #: Recent role errors, oldest first (the last few).
    errors: tuple[RoleError, ...] = ()
    #: Why a role ended the node, once it did.
    failed: str | None = None
    reports: tuple[PeerReport, ...] = ()
    trainer: TrainerWindow | None = None
    #: Bytes the node's connections sent and received: TCP payload as the kernel counted it
    #: (``wire_measured``), or where it cannot, what the node pushed and gossiped and the
    #: uploads it took in.
    bytes_sent: int = 0
    bytes_received: int = 0
    wire_measured: bool = False
    pid: int = 0
    #: The aggregation backend in use: "native (packaged)" (the kernel of the wheel),
    #: "native (built)" (compiled on first use), "torch (why)"; None until the node first
    #: aggregated.
    aggregation_backend: str | None = None
    #: None while writes go through; the problem while the disk refuses them.
    storage: StorageProblem | None = None
    #: The blob store: its blobs and their bytes (partial downloads not counted); what the
    #: node deleted since it started (blobs, bytes, passes that failed); and how many
    #: certified heads' blobs it keeps (None: an archive node keeps every blob).
    store_blobs: int = 0
    store_bytes: int = 0
    blobs_collected: int = 0
    bytes_collected: int = 0
    collect_failures: int = 0
    keep_heads: int | None = None
    #: The latest head with metrics reports (None: no evaluator reported yet).
    validation: ValidationMetrics | None = None
    #: A trainer's training data: its kind, what it is, where it lives, and for prepared
    #: shards what the node holds and fetched.
    data: DataStatus | None = None
    #: Certified windows in the node's verified chain, the updates its heads accepted and
    #: rejected (by the reason's label), and the windows that failed here (by reason);
    #: ``/metrics`` reports the same figures (:mod:`p2ptrain.observe.telemetry`).
    windows_certified: int = 0
    windows_failed: dict[str, int] = msgspec.field(default_factory=dict)
    updates_accepted: int = 0
    updates_rejected: dict[str, int] = msgspec.field(default_factory=dict)
    #: On a certificate network: this node's certificate, and the peers it refuses because
    #: an issuer revoked them.
    admission: Admission | None = None
    revoked: tuple[RevokedPeer, ...] = ()
    #: Peers the tip's quarantine book keeps out of the next window.
    quarantined_peers: int = 0
    #: Bytes moved by kind (update, aggregate, state, shard, gossip, other): blobs as
    #: fetched, pushed and served, gossip as framed.
    bytes_sent_by_kind: dict[str, int] = msgspec.field(default_factory=dict)
    bytes_received_by_kind: dict[str, int] = msgspec.field(default_factory=dict)
    #: Role errors since the node started.
    role_errors: int = 0
    #: Where ``--metrics-listen`` serves ``/metrics`` and the dashboard (None: not asked).
    metrics_address: str | None = None
    #: What following the chain costs this node since it started: the copies of the chain
    #: (and of the weights and outer state) it keeps (one, whatever its roles), the heads it
    #: adopted, the outer steps that moved its base and the certificates it verified (each
    #: costs ``quorum`` signature checks).
    chains: int = 0
    heads_adopted: int = 0
    outer_steps: int = 0
    certificate_checks: int = 0
    #: The node process's peak resident memory so far, in MiB (0: not measured), and its
    #: resident memory after imports, before any model state was built (None: not noted).
    peak_rss_mib: float = 0.0
    rss_after_imports_mib: float | None = None
    #: A reducer's or validator's last reduction of a window (its own cohort, or a
    #: proposal's recomputed): the window, its wall seconds and the updates it accepted
    #: (None: none yet, or no such role); and every reduction since the node started, with
    #: their wall seconds in all. Measured on this node, for people: never in a record.
    reduction_window: int | None = None
    reduction_seconds: float | None = None
    reduction_accepted: int | None = None
    reductions_timed: int = 0
    reduction_seconds_total: float = 0.0

    @property
    def reasons(self) -> list[str]:
        """The last few reasons peers were reported for."""
        return [r.reason for r in self.reports[-5:]]


_decoder = msgspec.json.Decoder(NodeStatus)


def encode_status(status: NodeStatus) -> bytes:
    return msgspec.json.format(msgspec.json.encode(status), indent=1)


def decode_status(data: bytes | str, where: str) -> NodeStatus:
    try:
        status: NodeStatus = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise LocalError(
            f"the status from {where} does not read as a p2ptrain node status ({exc}); is it "
            "a node of another p2ptrain version?"
        ) from exc
    return status


def read_status(data_dir: Path) -> NodeStatus:
    """The status a node last wrote in ``data_dir``."""
    path = data_dir / STATUS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise LocalError(
            f"{data_dir} has no status file: is it a node's data directory, and has the node "
            "run? (pass an http address to ask a running node directly)"
        ) from None
    except OSError as exc:
        raise LocalError(f"cannot read {path}: {exc}") from exc
    return decode_status(data, str(path))


def mean_bytes_by_kind(statuses: Sequence[NodeStatus], direction: str) -> dict[str, int]:
    """The nodes' mean bytes ``direction`` ("sent" or "received") by kind (update,
    aggregate, state, shard, gossip, other: what the node's telemetry counted), each
    rounded down; kinds nobody moved are left out."""
    totals: dict[str, int] = {}
    for status in statuses:
        counted = (
            status.bytes_sent_by_kind if direction == "sent" else status.bytes_received_by_kind
        )
        for kind, n in counted.items():
            totals[kind] = totals.get(kind, 0) + n
    return {kind: n // len(statuses) for kind, n in sorted(totals.items()) if n}
