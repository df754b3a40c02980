"""What a running node tells the program that runs it, as typed records.

A node calls its ``on_event`` callback with one of these as things happen; ``p2ptrain node
--json`` writes each as one JSON object per line (``{"event": "adopted", ...}``: the tag is
the ``event`` field), and :func:`decode_event` reads such a line back into its record, so the
demo, the Trainer API and the tests read fields, never string keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:  # annotations only: the command line reads events without the records
    from p2ptrain.core.records import Head


__all__ = [
    "Attested",
    "CatchingUp",
    "Evaluated",
    "Exited",
    "HeadAdopted",
    "NodeEvent",
    "PeerReported",
    "Published",
    "Ready",
    "RoleFailure",
    "ShardsFetched",
    "Stopped",
    "Trained",
    "TrainingStarted",
    "compute_utilisation",
    "decode_event",
    "encode_event",
    "left_out_reason",
    "mean_utilisation",
    "update_outcome",
]


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="event"):
    #: The node that said it ("" for :class:`Exited`, which its parent says).
    peer_id: str


class Ready(_Event, tag="ready", frozen=True):
    """The node is up: serving at ``address`` (None: outbound only) at ``height``."""

    address: str | None
    experiment_id: str
    height: int
    roles: tuple[str, ...] = ()
    #: Where ``--metrics-listen`` serves ``/metrics`` and the dashboard (None: not asked).
    metrics_address: str | None = None


class HeadAdopted(_Event, tag="adopted", frozen=True):
    """The node adopted a newly certified head (once per height, whatever its roles)."""

    height: int
    head_id: str
    accepted: int
    quarantined: int
    reason: str
    #: Seconds since the node adopted the previous head (or started).
    seconds: float
    #: What became of this node's own update for the window (a trainer's): "accepted",
    #: "rejected: <why>", "left out: <why>"; empty when the node sent none.
    update: str = ""
    #: The blob id (SHA-256) of the head's weights, in the node's blob store (what a
    #: watcher reads to evaluate the head while the node runs).
    weights_blob: str = ""


class ShardsFetched(_Event, tag="shards_fetched", frozen=True):
    """A trainer fetched the prepared shards its lease for ``window`` needed."""

    window: int
    shards: tuple[str, ...]
    #: Bytes that came in from peers for them, and how long it took.
    bytes: int
    seconds: float


class TrainingStarted(_Event, tag="training", frozen=True):
    """A trainer has its lease's data and starts the inner steps of ``window``."""

    window: int
    #: Seconds spent getting the lease's data ready (fetching shards).
    data_seconds: float


class Trained(_Event, tag="trained", frozen=True):
    """The trainer ran a window's inner steps and encoded its update."""

    window: int
    loss_before: float
    loss_after: float
    seconds: float
    blob_bytes: int
    #: Seconds inside the inner steps alone (``seconds`` also counts the data, the
    #: encoding and saving the optimizer state), and when they ended (``time.time()``).
    inner_seconds: float = 0.0
    inner_ended_at: float = 0.0


class Published(_Event, tag="published", frozen=True):
    """The trainer's update for ``window`` went out."""

    window: int
    update_id: str
    bytes: int


class Attested(_Event, tag="attested", frozen=True):
    """This validator voted for the head ``head_id`` at ``height``: its ``prevote`` or
    ``commit`` in voting round ``round``."""

    height: int
    head_id: str
    round: int
    stage: str


class Evaluated(_Event, tag="evaluated", frozen=True):
    """This node evaluated the certified head ``head_id`` at ``height`` on the validation
    data and published its signed metrics report (``skipped``: older heads adopted while it
    evaluated, left out to catch up)."""

    height: int
    head_id: str
    loss: float
    perplexity: float | None
    samples: int
    seconds: float
    skipped: int = 0


class PeerReported(_Event, tag="reported", frozen=True):
    """A peer sent something proven bad (counted against it)."""

    peer: str
    reason: str


class CatchingUp(_Event, tag="catching_up", frozen=True):
    """A role's base fell more than one height behind the certified chain it knows (a
    restart, a join, a long outage), or no peer holds the state it needs to catch up:
    ``reason`` says where it stands ("catching up: at height h, tip H ...")."""

    role: str
    reason: str


class RoleFailure(_Event, tag="role_error", frozen=True):
    """A step of one of the node's roles raised; the role goes on with the next window
    until ``failures`` reaches ``limit`` in a row, when the node stops."""

    role: str
    window: int
    step: str
    error: str
    message: str
    failures: int
    limit: int


class Stopped(_Event, tag="stopped", frozen=True):
    """The node stopped at ``height`` (``failed``: why, if a role ended it)."""

    height: int
    failed: str | None = None


class Exited(_Event, tag="exited", frozen=True):
    """A node process's event stream ended (said by the parent that ran it)."""

    returncode: int | None = None


NodeEvent = (
    Ready
    | HeadAdopted
    | ShardsFetched
    | TrainingStarted
    | Trained
    | Published
    | Attested
    | Evaluated
    | PeerReported
    | CatchingUp
    | RoleFailure
    | Stopped
    | Exited
)

_decoder = msgspec.json.Decoder(NodeEvent)


def encode_event(event: NodeEvent) -> bytes:
    """One JSON object, no newline."""
    return msgspec.json.encode(event)


def decode_event(line: bytes | str) -> NodeEvent | None:
    """The event on ``line`` (None for anything else: a log line, an unknown event)."""
    try:
        event: NodeEvent = _decoder.decode(line)
    except msgspec.DecodeError:
        return None
    return event


def update_outcome(
    head: Head, update_id: str | None, peer_id: str, before: Head | None = None
) -> str:
    """What became of our update ``update_id`` (None: we sent none) in ``head``'s window:
    accepted, rejected (the quarantine book counted a strike or a quarantine against us in
    this window, compared with ``before``, the parent head; the book says why) or left out
    (the window closed without it: it came late, or the window was full)."""
    if update_id is None:
        return ""
    if update_id in head.accepted:
        return "accepted"
    mine = next((e for e in head.quarantine if e.peer_id == peer_id), None)
    earlier = None
    if before is not None:
        earlier = next((e for e in before.quarantine if e.peer_id == peer_id), None)
    if mine is not None:
        struck = (mine.strikes, mine.offences) != (
            (earlier.strikes, earlier.offences) if earlier is not None else (0, 0)
        )
        if struck if before is not None else (mine.strikes or mine.until_window >= head.height):
            return f"rejected: {mine.describe()}"
    return f"left out: {left_out_reason(len(head.accepted))}"


def left_out_reason(accepted: int) -> str:
    """Why an update a head does not name was left out of its window."""
    return (
        f"the window closed with {accepted} updates without it (it came late, or the "
        "window was full)"
    )


def compute_utilisation(trained: Sequence[Trained]) -> float | None:
    """One trainer's share of time spent in inner steps: the seconds inside them over the
    wall seconds from its first step's start to its last step's end (None: it trained no
    window). 1.0 means it never waited between windows."""
    timed = [t for t in trained if t.inner_ended_at > 0]
    if not timed:
        return None
    first = min(t.inner_ended_at - t.inner_seconds for t in timed)
    last = max(t.inner_ended_at for t in timed)
    busy = sum(t.inner_seconds for t in timed)
    return busy / (last - first) if last > first else 1.0


def mean_utilisation(trainers: Iterable[Sequence[Trained]]) -> float | None:
    """The mean :func:`compute_utilisation` of the trainers that trained (each given its
    ``trained`` events), to 4 places; None if none did."""
    shares = [share for t in trainers if (share := compute_utilisation(t)) is not None]
    return round(sum(shares) / len(shares), 4) if shares else None
