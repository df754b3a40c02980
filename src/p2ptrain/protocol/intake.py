"""What a node lets in: each record from a peer is judged before anything is kept or forwarded.

Every node (and the simulator) runs the same rules on a verified record (its signature and
author checked) before it stores, buffers or forwards it:

* **entitled** -- a proposal must be signed by a reducer or a validator of the experiment,
  an attestation by a validator, an update must name the experiment's codec, a blob no
  larger than the codec's bound and only shards of the dataset. A record that breaks one of
  these is *rejected*: it is dropped and counted against its signer (the signature proves
  who sent it, so an honest forwarder is never blamed -- it would not have forwarded it);
* **near** -- a record for a window far ahead of the node's own is *ignored*: dropped, not
  stored, not forwarded and counted against nobody (the node may be the one lagging, and
  its honest neighbours must not be struck for that);
* otherwise it is *accepted*.

Records accepted for a window the node has not opened yet wait in an :class:`EarlyBuffer`,
bounded in bytes per signer and in total, until the window opens.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from p2ptrain.aggregate.codecs import codec_at
from p2ptrain.core.envelope import Signed
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Attestation, Proposal, Update

__all__ = [
    "AHEAD_WINDOWS",
    "Admission",
    "EarlyBuffer",
    "IntakeRules",
    "window_of",
]

#: How many windows past the node's open window a record may be for and still be kept
#: (buffered until its window opens); anything further ahead is ignored.
AHEAD_WINDOWS = 1


@dataclass(frozen=True, slots=True)
class Admission:
    """The verdict on one record: accepted, ignored, or rejected against ``signer``."""

    accepted: bool
    reason: str = ""
    #: The peer id the rejection counts against (None: ignored, nobody is blamed).
    blame: str | None = None

    @property
    def rejected(self) -> bool:
        return self.blame is not None


ACCEPTED = Admission(True)


def window_of(record: Any) -> int | None:
    """The window (height) a protocol record belongs to, None for other records."""
    if isinstance(record, Update | Proposal):
        return record.window
    if isinstance(record, Attestation):
        return record.height
    return None


class IntakeRules:
    """The rules of one experiment (see the module docstring)."""

    def __init__(
        self,
        manifest: ExperimentManifest,
        experiment_id: str,
        *,
        max_update_bytes: int,
        ahead_windows: int = AHEAD_WINDOWS,
    ) -> None:
        self.manifest = manifest
        self.experiment_id = experiment_id
        self.max_update_bytes = max_update_bytes
        self.ahead_windows = ahead_windows
        self._validators = frozenset(manifest.validators)
        self._proposers = self._validators | frozenset(manifest.reducers)
        self._shards = frozenset(shard.name for shard in manifest.dataset.shards)
        #: Keys whose admission an issuer revoked: their records are refused (the node's
        #: network fills it as revocations arrive).
        self.revoked: Collection[bytes] = frozenset()

    def judge(self, signed: Signed[Any], open_window: int) -> Admission:
        """The verdict on ``signed`` for a node whose open window is ``open_window``."""
        record = signed.record
        if signed.envelope.signer in self.revoked:  # a forwarder may not have heard yet
            return Admission(False, "its signer's admission to the network was revoked")
        reason = self._entitlement(record)
        if reason is not None:  # the signer is named only when blamed (not on the hot path)
            return Admission(False, reason, peer_id_of(signed.envelope.signer))
        window = window_of(record)
        if window is not None and window > open_window + self.ahead_windows:
            return Admission(False, f"window {window} is far ahead of ours ({open_window})")
        return ACCEPTED

    def _entitlement(self, record: Any) -> str | None:
        """Why the record's author may not send it, or None."""
        if getattr(record, "experiment_id", None) != self.experiment_id:
            return "record for another experiment"
        if isinstance(record, Update):
            if record.codec != codec_at(self.manifest.codec, record.window).name:
                return f"update in codec {record.codec!r}, not the experiment's"
            if record.delta_bytes > self.max_update_bytes:
                return f"update blob of {record.delta_bytes} bytes is over the codec's bound"
            if not self._shards.issuperset(record.lease_shards):
                return "update leases shards the dataset does not have"
        elif isinstance(record, Proposal):
            if record.reducer not in self._proposers:
                return "proposal from a key that is neither a reducer nor a validator"
            named = len(record.accepted) + len(record.rejected)
            if named > self.manifest.window.max_updates:
                return "proposal names more updates than window.max_updates"
        elif isinstance(record, Attestation) and record.validator not in self._validators:
            return "attestation from a key that is not a validator"
        return None


T = TypeVar("T")


@dataclass
class _Held(Generic[T]):
    window: int
    signer: str
    size: int
    item: T


@dataclass
class EarlyBuffer(Generic[T]):
    """Items for windows not open yet, keyed by id, bounded in bytes per signer and in total.

    :meth:`add` refuses (returns False) what would pass either bound; :meth:`take` hands back
    what belongs to the now-open window, keeps what is still ahead and forgets the rest.
    """

    per_signer_bytes: int
    total_bytes: int
    _held: dict[str, _Held[T]] = field(default_factory=dict)
    _by_signer: dict[str, int] = field(default_factory=dict)
    _total: int = 0

    def add(self, key: str, window: int, signer: str, size: int, item: T) -> bool:
        if key in self._held:
            return True
        if self._by_signer.get(signer, 0) + size > self.per_signer_bytes:
            return False
        if self._total + size > self.total_bytes:
            return False
        self._held[key] = _Held(window, signer, size, item)
        self._by_signer[signer] = self._by_signer.get(signer, 0) + size
        self._total += size
        return True

    def take(self, window: int) -> list[T]:
        """The items of ``window`` (in arrival order); items of earlier windows are dropped."""
        ready: list[T] = []
        for key, held in list(self._held.items()):
            if held.window <= window:
                self._drop(key)
                if held.window == window:
                    ready.append(held.item)
        return ready

    def _drop(self, key: str) -> None:
        held = self._held.pop(key)
        left = self._by_signer[held.signer] - held.size
        if left:
            self._by_signer[held.signer] = left
        else:
            del self._by_signer[held.signer]
        self._total -= held.size

    @property
    def bytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._held)
