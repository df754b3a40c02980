"""Asking peers for what this node missed.

* **The chain above our height** (:func:`fetch_chain`): a page of certified heads from a
  peer, hedged among a few, with the heights whose states the peer holds; the follower
  verifies each link. A role's catch-up and the node's periodic sync ask through it.
* **A stuck window's records** (:func:`sync_window`, anti-entropy for a participant's
  :class:`~p2ptrain.protocol.effects.WindowSync`): which updates and proposals of the
  window a few peers keep, and those we lack, fetched from whoever named them. Each record
  is verified (signature, its id) and judged by the node's intake rules, like gossip.

A peer that serves bytes proven bad is blamed; one that does not answer is a transport
fault (asked after the others for a while).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from p2ptrain.core.envelope import Signed, open_envelope
from p2ptrain.core.records import Proposal, Update
from p2ptrain.driver.racing import SMALL_ANSWER_S
from p2ptrain.driver.services import PeerServices
from p2ptrain.errors import ProtocolViolation, TransportError
from p2ptrain.protocol.chain import HELD_HEADS_REPORTED, MAX_LINKS_PER_PAGE, ChainPage

__all__ = ["NothingAbove", "fetch_chain", "sync_window"]

logger = logging.getLogger(__name__)

#: A window sync asks this many peers which records they hold.
_SYNC_PEERS = 3
_SYNC_KINDS: dict[str, type[Any]] = {"update": Update, "proposal": Proposal}


class NothingAbove(TransportError):
    """No peer asked for the certified chain had heads above ours (said with what each
    did): the usual answer of a node's periodic sync, not a fault."""


async def fetch_chain(
    services: PeerServices,
    height: Callable[[], int],
    address: str | None = None,
    among: Sequence[str] | None = None,
) -> ChainPage:
    """A page of the certified heads above ``height()`` from a peer (``address``, or
    those ``among``, or the providers; hedged): the first answer with links above ours,
    with what its node holds. One catch-up page at a time (a role waits for another's,
    then asks only for what it still lacks). The links are checked by the machine that
    receives them. Raises :class:`TransportError` saying what each peer asked did when
    none had heads above ours."""
    async with services.catching_up:
        above = height()
        outcomes: dict[str, str] = {}

        async def ask(provider: str) -> ChainPage | None:
            try:
                answer = await services.net.head_links(provider, services.experiment_id, above)
            except TransportError as exc:
                services.transport_fault(provider, str(exc))
                outcomes[provider] = str(exc)
                return None
            except ProtocolViolation as exc:
                services.blame(provider, f"served a bad page of certified heads: {exc}")
                outcomes[provider] = f"a bad answer ({exc})"
                return None
            links = tuple((h, c) for h, c in answer.links[:MAX_LINKS_PER_PAGE] if h.height > above)
            if not links:
                outcomes[provider] = f"no certified heads above height {above} (its tip: "
                outcomes[provider] += f"{answer.tip})"
                return None
            held = frozenset(sorted(answer.held)[-HELD_HEADS_REPORTED:])
            return ChainPage(links, answer.tip, held, services.key_at(provider))

        if address is not None:
            among = [address]
        asked = services.providers() if among is None else list(among)
        found = await services.first_answer(asked, ask)
        if found is None:
            said = "; ".join(f"{a}: {outcomes.get(a, 'no answer')}" for a in asked)
            raise NothingAbove(f"catch-up above height {above}: {said or 'no peers'}")
        return found


async def sync_window(
    services: PeerServices, window: int, held: frozenset[str], first: Sequence[str] = ()
) -> list[Signed[Any]]:
    """Anti-entropy: ask a few peers which updates and proposals of ``window`` they keep
    and fetch the ones not in ``held`` from whoever named them. Each record is verified
    (signature, its id) and judged by the node's intake rules, like gossip. The peers
    ``first`` (proposers whose proposal we lack) are asked as well as the few others."""
    asked = [a for p in first if (a := services.net.address_of(p)) is not None]
    peers = list(dict.fromkeys(asked + services.providers()[:_SYNC_PEERS]))

    async def holdings(address: str) -> list[tuple[str, str, str]]:
        try:
            async with asyncio.timeout(SMALL_ANSWER_S):
                answer = await services.net.window_records(address, services.experiment_id, window)
        except (TransportError, TimeoutError) as exc:
            services.transport_fault(address, str(exc) or "no answer")
            return []
        except ProtocolViolation as exc:
            services.blame(address, f"answered a window sync badly: {exc}")
            return []
        return [
            *(("update", i, address) for i in answer.updates),
            *(("proposal", i, address) for i in answer.proposals),
        ]

    wanted: dict[str, tuple[str, str]] = {}
    for named in await asyncio.gather(*(holdings(a) for a in peers)):
        for kind, record_id, address in named:
            if record_id not in held:
                wanted.setdefault(record_id, (kind, address))

    async def fetch(record_id: str, kind: str, address: str) -> Signed[Any] | None:
        try:
            async with asyncio.timeout(SMALL_ANSWER_S):
                raw = await services.net.record(address, record_id)
            signed = open_envelope(raw, _SYNC_KINDS[kind])
            if signed.record_id != record_id or signed.record.window != window:
                raise ProtocolViolation(f"named {kind} {record_id[:12]} but served another")
        except (TransportError, TimeoutError) as exc:
            services.transport_fault(address, str(exc) or "no answer")
            return None
        except ProtocolViolation as exc:
            services.blame(address, f"served a bad {kind} in a window sync: {exc}")
            return None
        admission = services.admit(signed)
        if admission.rejected and admission.blame:
            services.report(admission.blame, f"{kind} rejected: {admission.reason}")
        return signed if admission.accepted else None

    found = await asyncio.gather(*(fetch(i, k, a) for i, (k, a) in wanted.items()))
    records = [signed for signed in found if signed is not None]
    if records:
        logger.info("window %d: a sync found %d record(s) we lacked", window, len(records))
    return records
