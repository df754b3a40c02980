"""What the effect policy (:mod:`.policy`) asks its transport to do: the node or the simulator.

Effects are primitives of a transport -- send, keep, fetch once, train, wait -- with every
decision already taken: what to keep before what is sent (a list of effects is carried out
in order), whom to ask first, how long to wait before asking again. A transport carries
them out and hands each fetch's outcome back to the policy (:meth:`RolePolicy.fetched`,
:meth:`RolePolicy.fetch_failed`), which decides what follows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2ptrain.core.certificate import CertifiedLink
from p2ptrain.core.envelope import Signed
from p2ptrain.core.records import Head, Update
from p2ptrain.core.spool import Blob
from p2ptrain.protocol.actions import Adopted, Notice, Reported, Train
from p2ptrain.protocol.ballot import Ballot

__all__ = [
    "AggregateFetch",
    "BlobFetch",
    "ChainFetch",
    "Effect",
    "Fetch",
    "KeepState",
    "Publish",
    "RecordFetch",
    "Request",
    "StateFetch",
    "StoreBlob",
    "StoreRecord",
    "StoreVote",
    "TrainLater",
    "WindowSync",
]


@dataclass(frozen=True, slots=True)
class Publish:
    """Send a signed record (or a certified head) to the peers that act on it, and to the
    node's other roles. An update's ``blob`` is stored before (a :class:`StoreBlob`)."""

    kind: str
    record: Signed[Any] | CertifiedLink
    blob: bytes | None = None
    #: Sent before (a trainer's update that no proposal named in time): said again.
    again: bool = False


@dataclass(frozen=True, slots=True)
class StoreBlob:
    """Keep these bytes (peers fetch them by hash); ``blob_id``, their hash when known: a
    transport that holds it already skips the write."""

    data: Blob
    blob_id: str | None = None


@dataclass(frozen=True, slots=True)
class KeepState:
    """Keep the weights and optimizer state of the adopted head ``head`` (peers fetch them,
    and a restart resumes from them): ``blobs()`` encodes them, asked only by a transport
    that does not hold them yet (a state fetched from a peer is held already)."""

    head: Head
    blobs: Callable[[], tuple[bytes | bytearray, bytes | bytearray | None] | None]


@dataclass(frozen=True, slots=True)
class StoreRecord:
    """Keep a signed record peers may ask for by id (pruned by window)."""

    signed: Signed[Any]
    kind: str
    window: int


@dataclass(frozen=True, slots=True)
class StoreVote:
    """Persist what this validator voted at ``height`` (before it says so): it never votes
    twice in one round, not even across a crash."""

    height: int
    ballot: Ballot


@dataclass(frozen=True, slots=True)
class BlobFetch:
    """An update's blob, from the peers named ``first`` (then anyone holding it)."""

    update: Signed[Update]
    first: tuple[str, ...]
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class RecordFetch:
    """The signed update ``update_id`` a proposal named, from its proposer first."""

    update_id: str
    proposer: str
    window: int
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class StateFetch:
    """The weights (and optimizer state) of a certified head we did not compute."""

    head: Head
    head_id: str
    first: tuple[str, ...]
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class AggregateFetch:
    """The aggregate of a certified head whose parent's state we hold (the peers named
    ``first``, then anyone holding it)."""

    head: Head
    head_id: str
    first: tuple[str, ...]
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class ChainFetch:
    """A page of the certified heads above ``after_height`` (catch-up); the answer is a
    :class:`~.chain.ChainPage`."""

    peer: str | None
    after_height: int


@dataclass(frozen=True, slots=True)
class WindowSync:
    """Ask peers which updates and proposals of ``window`` they hold (ids), and fetch the
    records we do not (``held``); the answer is the verified records that passed intake.
    ``first``: peer ids asked before the others (proposers whose proposal we lack)."""

    window: int
    held: frozenset[str]
    first: tuple[str, ...] = ()


Request = BlobFetch | RecordFetch | StateFetch | AggregateFetch | ChainFetch | WindowSync


@dataclass(frozen=True, slots=True)
class Fetch:
    """Try ``request`` once, after ``delay_s`` seconds."""

    request: Request
    delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TrainLater:
    """Training ``train`` failed: offer it again after ``delay_s`` (:meth:`train_due`)."""

    train: Train
    delay_s: float


Effect = (
    Publish
    | StoreBlob
    | KeepState
    | StoreRecord
    | StoreVote
    | Fetch
    | TrainLater
    | Train
    | Reported
    | Notice
    | Adopted
)
