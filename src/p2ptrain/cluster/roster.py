"""The members one member knows of: where they answer, who answered the last probe, who
refused it.

Addresses come from mDNS, from ``--peer`` and from what members tell each other (every
request and status carries the sender's known addresses, so views converge). A probe asks
every known address for its status at once, each with a timeout: the members that prove the
secret and train the same thing are the *view* (alive, one of us); the ones whose secret or
settings differ are remembered with the reason, and reported once (``refused`` events);
the silent ones are simply not in the view.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec

from p2ptrain.cluster import events
from p2ptrain.cluster.membership import Member
from p2ptrain.cluster.rendezvous import SecretDiffers
from p2ptrain.cluster.wire import (
    Incompatible,
    MemberInfo,
    Reply,
    Request,
    StatusReply,
    StatusRequest,
)
from p2ptrain.errors import ProtocolViolation, TransportError

__all__ = ["PROBE_TIMEOUT_S", "Asker", "Roster"]

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0  # one status exchange
MAX_ADDRESSES = 256

#: ``ask(address, request, timeout_s) -> (proven peer id, reply)``.
Asker = Callable[[str, Request, float], Awaitable[tuple[str, Reply]]]


class Roster:
    """Known addresses, the last probe's view, and the members that refused us."""

    def __init__(self, *, me: str, ask: Asker, on_event: Callable[[events.ClusterEvent], None]):
        self.me = me
        self.own_address = ""
        self.ask, self._emit = ask, on_event
        self.addresses: set[str] = set()
        #: Peer id -> status, of the members that answered the last probe.
        self.views: dict[str, MemberInfo] = {}
        #: Peer ids that ever proved the secret to us (and we to them).
        self.found: set[str] = set()
        #: Address -> why it is not one of us (another secret, another workload).
        self.differs: dict[str, str] = {}
        self._refused_seen: set[str] = set()

    def learn(self, address: str) -> None:
        host, sep, port = address.rpartition(":")
        valid = sep and host and port.isdigit() and address != self.own_address
        if valid and len(self.addresses) < MAX_ADDRESSES:
            self.addresses.add(address)

    def known(self) -> tuple[str, ...]:
        return tuple(sorted(self.addresses))

    def members(self) -> list[Member]:
        return [info.member() for info in self.views.values()]

    def address_of(self, peer_id: str | None) -> str | None:
        """Where ``peer_id`` answered the last probe (None: it did not)."""
        info = self.views.get(peer_id or "")
        return None if info is None else info.address

    def drop(self, peer_id: str) -> None:
        """``peer_id`` did not answer: out of the view until the next probe finds it."""
        self.views.pop(peer_id, None)

    async def probe(self, me: MemberInfo) -> None:
        """Ask every known address for its status; the view is who answered as one of us."""
        targets = sorted(self.addresses)
        results = await asyncio.gather(*(self._probe_one(a, me) for a in targets))
        self.views = {info.peer_id: info for info in results if info is not None}

    async def _probe_one(self, address: str, me: MemberInfo) -> MemberInfo | None:
        try:
            peer, reply = await self.ask(
                address, StatusRequest(member=me, known=self.known()), PROBE_TIMEOUT_S
            )
        except SecretDiffers as exc:
            self.differ(address, str(exc))
            return None
        except (TransportError, ProtocolViolation) as exc:
            log.debug("cluster: %s: %s", address, exc)
            return None
        if isinstance(reply, Incompatible):
            self.differ(address, reply.reason)
            return None
        if not isinstance(reply, StatusReply) or reply.member.peer_id != peer or peer == self.me:
            return None
        self.differs.pop(address, None)
        for known in reply.known:
            self.learn(known)
        if peer not in self.found:
            self.found.add(peer)
            self._emit(events.MemberFound(peer=peer, address=address))
        return msgspec.structs.replace(reply.member, address=address)

    def differ(self, address: str, reason: str) -> None:
        """The member at ``address`` is not one of us, for ``reason`` (reported once)."""
        if address not in self.differs:
            self._emit(events.Refused(address=address, reason=reason))
        self.differs[address] = reason

    def refused_client(self, peer: str, reason: str) -> None:
        """Our endpoint refused ``peer`` (its proof of the secret failed): reported once."""
        if peer not in self._refused_seen:
            self._refused_seen.add(peer)
            self._emit(events.Refused(address=peer, reason=reason))
