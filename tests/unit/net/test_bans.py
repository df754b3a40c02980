"""A banned peer is told why: close code 1008 and the reason, over a closing handshake.

A node bans a peer from another task than the one reading the peer's socket
(``NetNode.strike`` spawns the close). The banned peer must read the close frame -- 1008 and
"banned: ..." -- and the banning node must keep its end open until the peer's own close frame
answers, reading and dropping what the peer sent meanwhile. A node that dropped the transport
right after its close frame reset a banned peer that was still sending, and that peer's event
loop, failing its next write, threw the unread close frame away: the peer saw 1006 (the
outsider of tests/chaos/test_junk_flood.py, now and then). Two nodes on loopback, port 0.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp
import pytest

from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.net.auth import ClientCredentials
from p2ptrain.net.client import PeerClient
from p2ptrain.net.config import NetConfig
from p2ptrain.net.connection import PeerConnection
from p2ptrain.net.node import NetNode
from p2ptrain.net.wire import Subscribe, encode_frame
from p2ptrain.store.blobs import BlobStore
from tests.support.builders import identity

NETWORK = NetworkManifest(name="bans", authority=identity(1).public_key)
REASON = "junk proposals"
#: Every wait here ends within this many seconds, or the test fails.
WAIT_S = 10.0


@asynccontextmanager
async def node(*, listen: bool) -> AsyncIterator[NetNode]:
    """A started node that bans at the first strike."""
    with tempfile.TemporaryDirectory() as blobs:
        config = NetConfig(host="127.0.0.1" if listen else None, strikes_to_ban=1)
        net_node = NetNode(
            identity=Identity.generate(), network=NETWORK, blobs=BlobStore(blobs), config=config
        )
        async with net_node:
            yield net_node


async def held_by(net_node: NetNode, peer_id: str) -> PeerConnection:
    """``net_node``'s gossip connection to ``peer_id``, once it is open."""
    async with asyncio.timeout(WAIT_S):
        await net_node.wait_connected()
    return net_node.gossip.connections[peer_id]


async def close_frame(ws: aiohttp.ClientWebSocketResponse) -> aiohttp.WSMessage:
    """The next close frame on ``ws``, past the gossip frames before it."""
    async with asyncio.timeout(WAIT_S):
        while True:
            message = await ws.receive()
            if message.type != aiohttp.WSMsgType.BINARY:
                return message


def test_a_ban_tells_the_peer_why_and_waits_for_its_answer() -> None:
    """The node's socket waits in ``receive()`` when the ban closes it from another task.
    The peer sends a few frames more, then answers the close frame by hand with the code it
    was given: the node's socket holds that code only if it read the answer, past those
    frames, before it let go of the transport."""

    async def scenario() -> tuple[aiohttp.WSMessage, int | None]:
        async with AsyncExitStack() as stack:
            seed = await stack.enter_async_context(node(listen=True))
            assert seed.address is not None
            outsider = PeerClient(ClientCredentials(NETWORK, Identity.generate(), secret=None))
            stack.push_async_callback(outsider.close)
            await outsider.ensure_nonce(seed.address)
            auth, _ = outsider.authorization(seed.address, "GET", "/ws")
            ws = await outsider.session.ws_connect(
                seed.address.replace("http", "ws", 1) + "/ws", headers=auth, autoclose=False
            )
            held = await held_by(seed, outsider.credentials.identity.peer_id)
            seed.strike(held.peer_id, REASON)
            told = await close_frame(ws)
            for _ in range(3):  # sent as if before it read the close frame: read and dropped
                await ws.send_bytes(encode_frame(Subscribe(["anything"])))
            await ws.close(code=told.data)  # the answer, echoing the code
            async with asyncio.timeout(WAIT_S):
                await held.wait_closed()
            return told, held.ws.close_code

    told, answer_read = asyncio.run(scenario())
    assert told.type == aiohttp.WSMsgType.CLOSE, told
    assert told.data == aiohttp.WSCloseCode.POLICY_VIOLATION, told
    assert told.extra == f"banned: {REASON}", told
    assert answer_read == aiohttp.WSCloseCode.POLICY_VIOLATION, (
        f"the node let go with close code {answer_read}, before the banned peer's answer"
    )


@pytest.mark.parametrize("banned", ["dialer", "listener"])
def test_a_banned_node_records_1008_and_why(banned: str) -> None:
    """The banned end -- the node that dialed, or the one that listened -- keeps the code
    and the reason of the close frame the ban sent."""

    async def scenario() -> tuple[int | None, str]:
        async with AsyncExitStack() as stack:
            seed = await stack.enter_async_context(node(listen=True))
            member = await stack.enter_async_context(node(listen=False))
            assert seed.address is not None
            async with asyncio.timeout(WAIT_S):
                await member.connect(seed.address)
            at_seed = await held_by(seed, member.peer_id)
            at_member = await held_by(member, seed.peer_id)
            if banned == "dialer":  # the seed bans the member, whose socket it accepted
                seed.strike(member.peer_id, REASON)
                banned_end = at_member
            else:  # the member bans the seed, whose socket it dialed
                member.strike(seed.peer_id, REASON)
                banned_end = at_seed
            async with asyncio.timeout(WAIT_S):
                await banned_end.wait_closed()
            return banned_end.close_code, banned_end.close_reason

    code, reason = asyncio.run(scenario())
    assert code == aiohttp.WSCloseCode.POLICY_VIOLATION, (code, reason)
    assert reason == f"closed with code 1008: banned: {REASON}", reason
