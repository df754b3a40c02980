"""Quarantine, decided inside head records so that every peer agrees on it.

A head carries every trainer's standing after its window (:class:`QuarantineEntry`). The
next head's standings follow from the previous ones and the window's outcome alone:

* a trainer whose update was rejected gets a strike; at ``screening.quarantine_after``
  strikes in a row it is excluded for ``quarantine_windows * 2**(offences)`` windows
  (doubling for each repeat offence, at most :data:`MAX_EXCLUSION` windows) and its strikes
  start over;
* an accepted update clears the trainer's strikes;
* an update from an excluded trainer is rejected without a strike (it is not screened).

Entries with nothing left to say (no strikes, no offences, exclusion over) are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from p2ptrain.core.manifests import ScreeningSpec
from p2ptrain.core.reasons import Reason
from p2ptrain.core.records import QuarantineEntry

__all__ = ["MAX_EXCLUSION", "excluded_until", "next_standings"]

#: The longest exclusion, in windows, however often a trainer offends.
MAX_EXCLUSION = 10_000


def excluded_until(standings: Sequence[QuarantineEntry], peer_id: str, window: int) -> int | None:
    """The last window of ``peer_id``'s exclusion if it covers ``window``, else None."""
    for entry in standings:
        if entry.peer_id == peer_id:
            return entry.until_window if entry.until_window >= window else None
    return None


def next_standings(
    previous: Iterable[QuarantineEntry],
    window: int,
    accepted: Iterable[str],
    rejected: Mapping[str, Reason],
    spec: ScreeningSpec,
) -> tuple[QuarantineEntry, ...]:
    """The standings after ``window`` from those before it, the trainers whose update was
    accepted and those whose update was rejected (peer id -> reason; excluded trainers are
    not in it). Sorted by peer id, as a head stores them."""
    standings = {entry.peer_id: entry for entry in previous}
    for peer_id in accepted:
        entry = standings.get(peer_id)
        if entry is not None and not entry.offences and entry.until_window <= window:
            del standings[peer_id]
        elif entry is not None:
            standings[peer_id] = QuarantineEntry(
                peer_id=peer_id,
                until_window=entry.until_window,
                reason=entry.reason,
                strikes=0,
                offences=entry.offences,
            )
    for peer_id in sorted(rejected):
        entry = standings.get(peer_id)
        strikes = (entry.strikes if entry else 0) + 1
        offences = entry.offences if entry else 0
        until, reason = (entry.until_window, entry.reason) if entry else (0, rejected[peer_id])
        if strikes >= spec.quarantine_after:
            length = min(MAX_EXCLUSION, spec.quarantine_windows * 2 ** min(offences, 20))
            until = window + length
            reason = rejected[peer_id]  # the rejection that made the trainer an offender
            strikes, offences = 0, offences + 1
        standings[peer_id] = QuarantineEntry(
            peer_id=peer_id, until_window=until, reason=reason, strikes=strikes, offences=offences
        )
    kept = [
        entry
        for entry in standings.values()
        if entry.strikes or entry.offences or entry.until_window > window
    ]
    return tuple(sorted(kept, key=lambda entry: entry.peer_id))
