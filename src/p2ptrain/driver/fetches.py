"""How a runner's fetches are answered from the network: one function per kind of request
(the dispatch table :data:`ANSWERS`), each through the node's peer services (providers
raced, bad bytes blamed) or :mod:`.catch_up`, and what each kind is called in the log."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from p2ptrain.core.envelope import Signed
from p2ptrain.core.records import Update
from p2ptrain.driver.catch_up import fetch_chain, sync_window
from p2ptrain.driver.services import PeerServices
from p2ptrain.errors import TransportError
from p2ptrain.protocol.chain import ChainPage
from p2ptrain.protocol.effects import (
    AggregateFetch,
    BlobFetch,
    ChainFetch,
    RecordFetch,
    Request,
    StateFetch,
    WindowSync,
)
from p2ptrain.protocol.reduction import ByteSource

__all__ = ["ANSWERS", "FETCHING", "answer"]

#: The height of the chain a fetch's answer builds on (a catch-up asks above it).
Height = Callable[[], int]


async def answer(services: PeerServices, height: Height, request: Request) -> Any:
    """The answer to ``request`` (the fetch's kind picks how: :data:`ANSWERS`)."""
    return await ANSWERS[type(request)](services, height, request)


async def _update_blob(services: PeerServices, height: Height, request: BlobFetch) -> ByteSource:
    update = request.update.record
    return await services.fetch_update_blob(update.delta_blob, request.first, update.delta_bytes)


async def _update_record(
    services: PeerServices, height: Height, request: RecordFetch
) -> Signed[Update]:
    signed = await services.fetch_update_record(request.update_id, request.proposer)
    if signed is None:
        raise TransportError(f"nobody served update {request.update_id[:12]}")
    return signed


async def _head_state(
    services: PeerServices, height: Height, request: StateFetch
) -> tuple[bytes | bytearray, bytes | bytearray | None]:
    return await services.fetch_head_blobs(request.head, request.first)


async def _aggregate(
    services: PeerServices, height: Height, request: AggregateFetch
) -> bytes | bytearray:
    assert request.head.aggregate_blob is not None
    blob_id = request.head.aggregate_blob
    return await services.fetch_blob(blob_id, request.first, kind="aggregate")


async def _window_records(
    services: PeerServices, height: Height, request: WindowSync
) -> list[Signed[Any]]:
    return await sync_window(services, request.window, request.held, request.first)


async def _chain_page(services: PeerServices, height: Height, request: ChainFetch) -> ChainPage:
    address = None
    if request.peer is not None and request.peer != services.peer_id:
        address = services.net.address_of(request.peer)
    return await fetch_chain(services, height, address)


#: How each kind of fetch is answered.
ANSWERS: dict[type[Any], Callable[[PeerServices, Height, Any], Awaitable[Any]]] = {
    BlobFetch: _update_blob,
    RecordFetch: _update_record,
    StateFetch: _head_state,
    AggregateFetch: _aggregate,
    WindowSync: _window_records,
    ChainFetch: _chain_page,
}

#: What each kind of fetch is called in the log and the failures.
FETCHING = {
    BlobFetch: "fetching an update",
    RecordFetch: "fetching a proposal's update",
    StateFetch: "fetching a head's weights",
    AggregateFetch: "fetching a head's aggregate",
    ChainFetch: "catching up",
    WindowSync: "asking peers what the window holds",
}
