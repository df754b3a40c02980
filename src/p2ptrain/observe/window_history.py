"""What each certified window was, as this node saw it: a bounded history for people.

For every head it certifies or adopts, a node keeps one :class:`WindowRecord`: the head and
the validators that signed it, each update of the window and what became of it (accepted,
rejected with the quarantine book's reason, or left out), the quarantine changes the head
made, how long each phase took here, the bytes this node moved meanwhile, and the
evaluators' median validation loss once their reports arrive. :class:`WindowHistory` keeps
the last :data:`KEEP_WINDOWS` of them and writes them to ``history.json`` in the data
directory, so the dashboard of a stopped node (``p2ptrain dashboard --dir``) still shows
them. Everything here comes from signed records the node verified (heads, certificates,
updates, metrics reports) and its own clocks and counters; nothing is a secret.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import msgspec

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.reasons import Code, Reason, describe
from p2ptrain.core.records import Head, QuarantineEntry
from p2ptrain.observe.events import left_out_reason
from p2ptrain.store.atomic import write_atomically

__all__ = [
    "HISTORY_FILE",
    "KEEP_WINDOWS",
    "PeerView",
    "QuarantineChange",
    "SeenUpdate",
    "UpdateFate",
    "WindowHistory",
    "WindowRecord",
    "reason_label",
    "rejections",
    "window_record",
]

logger = logging.getLogger(__name__)

HISTORY_FILE = "history.json"
#: Certified windows a node remembers for its dashboard.
KEEP_WINDOWS = 256
#: Rejected and left-out updates a window record lists (the rest are counted).
MAX_LISTED = 32


class _Record(msgspec.Struct, frozen=True, kw_only=True):
    pass


class SeenUpdate(_Record, frozen=True):
    """A signed update this node saw on the experiment's topic."""

    update_id: str
    window: int
    trainer: str  # peer id
    loss_before: float
    loss_after: float


class UpdateFate(_Record, frozen=True):
    """One update of a window and what became of it."""

    update_id: str
    trainer: str
    loss_before: float | None
    loss_after: float | None
    outcome: str  # accepted | rejected | left out
    reason: str = ""


class QuarantineChange(_Record, frozen=True):
    """A quarantine entry a head added or changed."""

    peer: str
    until_window: int
    reason: str
    strikes: int
    offences: int


class WindowRecord(_Record, frozen=True):
    height: int
    head_id: str
    #: Unix time this node adopted the head; seconds since it adopted the one before.
    certified_at: float
    seconds: float
    reason: str
    signers: tuple[str, ...]
    updates: tuple[UpdateFate, ...]
    quarantine: tuple[QuarantineChange, ...]
    #: Seconds per phase, as this node saw them (train, publish, fetch, reduce, attest,
    #: certify; only those it took part in or watched).
    phases: dict[str, float]
    bytes_sent: int
    bytes_received: int
    validation_loss: float | None = None
    validation_reports: int = 0
    #: Updates of the window the head does not name, listed or not (at most
    #: :data:`MAX_LISTED` are).
    left_out: int = 0


class PeerView(_Record, frozen=True):
    """A peer this node knows, for the dashboard's graph."""

    peer_id: str
    roles: tuple[str, ...]
    connected: bool
    banned: bool
    address: str | None
    #: Who its admission certificate says it is ("" without one, or when it does not say).
    subject: str = ""
    #: An issuer revoked its admission: this node refuses it for good.
    revoked: bool = False


def _changed(entry: QuarantineEntry, before: QuarantineEntry | None) -> bool:
    if before is None:
        return True
    return (entry.strikes, entry.offences, entry.until_window, entry.reason) != (
        before.strikes,
        before.offences,
        before.until_window,
        before.reason,
    )


def rejections(head: Head, parent: Head | None) -> list[QuarantineEntry]:
    """The quarantine entries whose strikes or offences ``head`` raised over ``parent``'s:
    the peers whose update of this window was rejected (the entry says why)."""
    before = {} if parent is None else {e.peer_id: e for e in parent.quarantine}
    rejected = []
    for entry in head.quarantine:
        earlier = before.get(entry.peer_id)
        strikes, offences = (0, 0) if earlier is None else (earlier.strikes, earlier.offences)
        # a strike more, or an offence more (the strike that quarantines starts the count
        # of strikes again); strikes that lapsed are no rejection
        if entry.strikes > strikes or entry.offences > offences:
            rejected.append(entry)
    return rejected


def window_record(
    head: Head,
    head_id: str,
    parent: Head | None,
    certificate: QuorumCertificate,
    seen: Mapping[str, SeenUpdate],
    *,
    certified_at: float,
    seconds: float,
    reason: str,
    phases: Mapping[str, float],
    bytes_sent: int,
    bytes_received: int,
    rejected: Mapping[str, Reason] | None = None,
) -> WindowRecord:
    """One window's record from its certified head, its parent and the updates seen.
    ``rejected``: the certified proposal's rejections (update id -> why), when this node saw
    that proposal; else the head's quarantine book says who was rejected (with the reason
    of their standing, which may be an earlier window's)."""
    window = head.height
    of_window = {u.update_id: u for u in seen.values() if u.window == window}
    fates: list[UpdateFate] = []
    for update_id in head.accepted:
        update = of_window.pop(update_id, None) or seen.get(update_id)
        fates.append(_fate(update_id, update, "accepted", ""))
    if rejected is not None:
        for update_id, why in list(rejected.items())[:MAX_LISTED]:
            update = of_window.pop(update_id, None) or seen.get(update_id)
            fates.append(_fate(update_id, update, "rejected", describe(why)))
    else:
        by_trainer = {u.trainer: u for u in of_window.values()}
        for entry in rejections(head, parent):
            update = by_trainer.pop(entry.peer_id, None)
            if update is not None:
                of_window.pop(update.update_id, None)
            update_id = "" if update is None else update.update_id
            said = describe(entry.reason)
            fates.append(_fate(update_id, update, "rejected", said, trainer=entry.peer_id))
    # updates the head does not name: listed up to a bound (anyone may sign updates)
    left_out = list(of_window.values())
    for update in left_out[:MAX_LISTED]:
        fates.append(
            _fate(update.update_id, update, "left out", left_out_reason(len(head.accepted)))
        )
    before = {} if parent is None else {e.peer_id: e for e in parent.quarantine}
    changes = tuple(
        QuarantineChange(
            peer=e.peer_id,
            until_window=e.until_window,
            reason=e.describe(),
            strikes=e.strikes,
            offences=e.offences,
        )
        for e in head.quarantine
        if _changed(e, before.get(e.peer_id))
    )
    return WindowRecord(
        height=head.height,
        head_id=head_id,
        certified_at=round(certified_at, 3),
        seconds=round(seconds, 3),
        reason=reason,
        signers=tuple(peer_id_of(s.validator) for s in certificate.signatures),
        updates=tuple(fates),
        quarantine=changes,
        phases={k: round(v, 4) for k, v in phases.items()},
        bytes_sent=bytes_sent,
        bytes_received=bytes_received,
        left_out=len(left_out),
    )


def _fate(
    update_id: str, update: SeenUpdate | None, outcome: str, reason: str, trainer: str = ""
) -> UpdateFate:
    """An update's fate (``trainer``: who sent it, when the update itself was not seen)."""
    return UpdateFate(
        update_id=update_id,
        trainer=trainer if update is None else update.trainer,
        loss_before=None if update is None else update.loss_before,
        loss_after=None if update is None else update.loss_after,
        outcome=outcome,
        reason=reason,
    )


def reason_label(reason: Reason) -> str:
    """The Prometheus label of a rejection reason: its code's name, lowercase
    (``norm_above``); a bounded set, one label per code."""
    return Code(reason.code).name.lower()


_decoder = msgspec.json.Decoder(list[WindowRecord])


class WindowHistory:
    """The last :data:`KEEP_WINDOWS` window records, kept in ``history.json``."""

    def __init__(self, data_dir: Path | None, keep: int = KEEP_WINDOWS) -> None:
        self.path = None if data_dir is None else data_dir / HISTORY_FILE
        self._records: deque[WindowRecord] = deque(maxlen=keep)
        self._dirty = False
        #: Grows at every change (the dashboard sends a snapshot when it moved).
        self.version = 0

    def load(self) -> None:
        """What an earlier run of the node kept (nothing, if the file is missing or bad)."""
        if self.path is None:
            return
        self._records.extend(read_history(self.path))

    def add(self, record: WindowRecord) -> None:
        if any(r.height == record.height for r in self._records):
            return  # a restart adopts its stored tip again: the earlier record stays
        self._records.append(record)
        self._changed()

    def set_validation(self, head_id: str, loss: float, reports: int) -> None:
        """The evaluators' median loss of ``head_id`` (when a report arrived)."""
        for i, record in enumerate(self._records):
            if record.head_id == head_id:
                if (record.validation_loss, record.validation_reports) != (loss, reports):
                    self._records[i] = msgspec.structs.replace(
                        record, validation_loss=loss, validation_reports=reports
                    )
                    self._changed()
                return

    def records(self) -> tuple[WindowRecord, ...]:
        return tuple(self._records)

    def _changed(self) -> None:
        self._dirty = True
        self.version += 1

    def save(self) -> None:
        """Write the file if anything changed since the last write."""
        if self.path is None or not self._dirty:
            return
        write_atomically(self.path, msgspec.json.encode(list(self._records)), durable=False)
        self._dirty = False


def read_history(path: Path) -> list[WindowRecord]:
    """The records in a ``history.json`` (none if it is missing or unreadable)."""
    try:
        return _decoder.decode(path.read_bytes())
    except FileNotFoundError:
        return []
    except (OSError, msgspec.DecodeError) as exc:
        logger.warning("%s does not read as a window history (%s); starting a new one", path, exc)
        return []
