"""What the window state machines ask their driver to do (the node or the simulator).

The machines never touch sockets or clocks; they return these, and the driver carries them
out: sends records, fetches what is missing, and tells the machine when it arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.envelope import Signed
from p2ptrain.core.records import Attestation, Head, Proposal, Update
from p2ptrain.protocol.ballot import Ballot

__all__ = [
    "Action",
    "Adopted",
    "FetchAggregate",
    "FetchChain",
    "FetchState",
    "FetchUpdates",
    "Notice",
    "Reported",
    "SendAttestation",
    "SendCertificate",
    "SendProposal",
    "SendUpdate",
    "SyncWindow",
    "Train",
]


@dataclass(frozen=True, slots=True)
class SendUpdate:
    """A trainer's update and its blob, for the window's reducers and validators
    (``again``: it was sent before, and no proposal named it in time)."""

    update: Signed[Update]
    blob: bytes
    again: bool = False


@dataclass(frozen=True, slots=True)
class SyncWindow:
    """The open window ``window`` is past its deadline without a certificate: ask peers
    which of its updates and proposals they hold (ids only) and fetch the ones we lack
    (anti-entropy: a message lost to a crash or a partition is repaired); ``proposers``:
    those whose slot passed and whose proposal we lack, asked first."""

    window: int
    proposers: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class SendProposal:
    """A proposal for the validators (they recompute it; blobs are fetched on demand)."""

    proposal: Signed[Proposal]


@dataclass(frozen=True, slots=True)
class SendAttestation:
    """An attestation for the validators and reducers (whoever gathers q assembles);
    ``ballot``: our own new vote's ballot, to store before it goes out; ``again``: our vote,
    sent once more because no certificate came of it."""

    attestation: Signed[Attestation]
    again: bool = False
    ballot: Ballot | None = None


@dataclass(frozen=True, slots=True)
class SendCertificate:
    """A newly assembled certificate and its head, for every peer."""

    head: Head
    certificate: QuorumCertificate


@dataclass(frozen=True, slots=True)
class FetchUpdates:
    """Fetch these updates (records and blobs) from ``peer``, who named them."""

    peer: bytes
    update_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FetchState:
    """Fetch the weights (and optimizer state) of ``head`` from ``peer``: it was certified
    without us computing it."""

    peer: bytes | None
    head: Head
    head_id: str


@dataclass(frozen=True, slots=True)
class FetchAggregate:
    """Fetch the aggregate of ``head`` from ``peer``: we hold its parent's state, so the
    aggregate (and our own outer step, checked against the head) is all we need."""

    peer: bytes | None
    head: Head
    head_id: str


@dataclass(frozen=True, slots=True)
class FetchChain:
    """Fetch a page of the certified heads above ``after_height`` from ``peer``
    (catch-up; the links are verified as they arrive, a held head's state is fetched
    after the last page)."""

    peer: bytes
    after_height: int


@dataclass(frozen=True, slots=True)
class Adopted:
    """The canonical head moved."""

    head: Head
    head_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Reported:
    """A peer misbehaved (counted against it)."""

    peer_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Notice:
    """Something the operator should know and the machine cannot fix by itself (no
    provider holds a state it needs): logged once at WARNING, shown in the status."""

    reason: str


@dataclass(frozen=True, slots=True)
class Train:
    """Train window ``window`` from the canonical head ``base_head`` on this lease."""

    window: int
    base_head: str


Action = (
    SendUpdate
    | SendProposal
    | SendAttestation
    | SendCertificate
    | FetchUpdates
    | FetchState
    | FetchAggregate
    | FetchChain
    | SyncWindow
    | Adopted
    | Reported
    | Notice
    | Train
)
