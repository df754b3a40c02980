"""The peers a node knows: verified signed records, and strikes and bans for misbehaviour."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from p2ptrain.core.envelope import Signed
from p2ptrain.core.records import PeerRecord
from p2ptrain.errors import ProtocolViolation

__all__ = ["PeerBook", "PeerBookStatistics"]

logger = logging.getLogger(__name__)

MAX_PEERS = 10_000
MAX_TRACKED = 100_000


@dataclass(frozen=True, slots=True)
class PeerBookStatistics:
    peers: int
    banned: int
    strikes: int
    records_rejected: int


class PeerBook:
    """Signed peer records by peer id (a higher ``seq`` replaces) and a strike score per
    peer id or remote address; ``strikes_to_ban`` strikes ban it for ``ban_s`` seconds.
    Strikes decay: each lapses ``strike_decay_s`` seconds after it was counted, so an honest
    peer's rare mistakes (or our own bugs) never add up to a ban over a long life."""

    def __init__(
        self,
        network_id: str,
        *,
        self_id: str,
        strikes_to_ban: int,
        ban_s: float,
        strike_decay_s: float = 600.0,
    ) -> None:
        self.network_id = network_id
        self.self_id = self_id
        self.strikes_to_ban = strikes_to_ban
        self.ban_s = ban_s
        self.strike_decay_s = strike_decay_s
        self._records: dict[str, Signed[PeerRecord]] = {}
        #: who -> when each of its strikes that has not lapsed was counted
        self._strikes: dict[str, tuple[float, ...]] = {}
        self._banned_until: dict[str, float] = {}
        self._total_strikes = 0
        self._rejected = 0

    def add(self, signed: Signed[PeerRecord]) -> bool:
        """Keep a verified record if it is news; return True when it changed the book."""
        record = signed.record
        if record.network_id != self.network_id:
            self._rejected += 1
            raise ProtocolViolation("peer record is for another network")
        peer_id = record.peer_id
        if peer_id == self.self_id:
            return False
        held = self._records.get(peer_id)
        if held is not None and held.record.seq >= record.seq:
            return False
        if held is None and len(self._records) >= MAX_PEERS:
            return False
        self._records[peer_id] = signed
        return True

    def forget(self, peer_id: str) -> None:
        """Drop ``peer_id``'s record (its admission was revoked): no one dials it again."""
        self._records.pop(peer_id, None)

    def get(self, peer_id: str) -> Signed[PeerRecord] | None:
        return self._records.get(peer_id)

    def __iter__(self) -> Iterator[Signed[PeerRecord]]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def strike(self, who: str, reason: str, now: float) -> bool:
        """Count one offence against ``who``; return True when this strike bans it."""
        self._prune(now)
        self._total_strikes += 1
        times = (*self._live_strikes(who, now), now)[-self.strikes_to_ban :]
        count = len(times)
        self._strikes.pop(who, None)  # re-inserted last: the oldest go first when pruning
        self._strikes[who] = times
        logger.warning(
            "peer %s: %s (strike %d of %d)", who[:16], reason, count, self.strikes_to_ban
        )
        if count >= self.strikes_to_ban:
            self._strikes.pop(who, None)
            self._banned_until[who] = now + self.ban_s
            logger.warning("peer %s banned for %.0f s", who[:16], self.ban_s)
            return True
        return False

    def strikes(self, who: str, now: float) -> int:
        """The strikes against ``who`` that have not lapsed by ``now``."""
        return len(self._live_strikes(who, now))

    def _live_strikes(self, who: str, now: float) -> tuple[float, ...]:
        return tuple(t for t in self._strikes.get(who, ()) if now - t < self.strike_decay_s)

    def ban(self, who: str, reason: str, now: float) -> None:
        self._prune(now)
        logger.warning("peer %s banned for %.0f s: %s", who[:16], self.ban_s, reason)
        self._banned_until[who] = now + self.ban_s

    def _prune(self, now: float) -> None:
        """Keep the tables bounded: expired bans go, and the oldest strike counts go first
        when too many keys (free to make on an open network) have one."""
        for key in [k for k, until in self._banned_until.items() if until <= now]:
            del self._banned_until[key]
        while len(self._strikes) >= MAX_TRACKED:
            del self._strikes[next(iter(self._strikes))]

    def banned(self, who: str, now: float) -> bool:
        until = self._banned_until.get(who)
        if until is None:
            return False
        if until <= now:
            del self._banned_until[who]
            return False
        return True

    def statistics(self) -> PeerBookStatistics:
        return PeerBookStatistics(
            peers=len(self._records),
            banned=len(self._banned_until),
            strikes=self._total_strikes,
            records_rejected=self._rejected,
        )
