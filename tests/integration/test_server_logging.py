"""A peer's malformed or aborted request is one WARNING line naming it, never a traceback."""

from __future__ import annotations

import asyncio
import logging
import tempfile

import pytest

from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.net.config import NetConfig
from p2ptrain.net.node import NetNode
from p2ptrain.store.blobs import BlobStore

pytestmark = pytest.mark.integration


async def _send_raw(address: str, data: bytes) -> bytes:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    async with asyncio.timeout(10):
        answer = await reader.read(200)
    writer.close()
    return answer


def test_an_over_long_request_line_is_one_warning_naming_the_peer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    authority = Identity.generate()
    network = NetworkManifest(name="logging", authority=authority.public_key)

    async def scenario() -> bytes:
        with tempfile.TemporaryDirectory() as blobs:
            node = NetNode(
                identity=Identity.generate(),
                network=network,
                blobs=BlobStore(blobs),
                config=NetConfig(),
                roles=("seed",),
            )
            async with node:
                assert node.address is not None
                line = b"GET /v1/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
                return await _send_raw(node.address, line)

    with caplog.at_level(logging.DEBUG):
        answer = asyncio.run(scenario())
    assert answer.split(b" ")[1] == b"400", answer  # refused, and the node still answers
    server = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert server, "aiohttp said nothing about the bad request"
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in server), [
        (r.levelname, r.getMessage()) for r in server
    ]
    assert any("bad request from 127.0.0.1" in r.getMessage() for r in server)
