"""The wire meter counts what a node's connections carry, as the kernel saw it: a blob sent
with ``sendfile``, an upload read by a handler, through connections that have closed and
through one that is still open."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from p2ptrain.net.wire_meter import loop_meter, metered_loop

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the wire meter reads Linux's TCP_INFO"
)

BLOB = 3_000_000
UPLOAD = 1_000_000


async def _exchange(blob: Path) -> tuple[tuple[int, int], tuple[int, int], int]:
    """Serve ``blob`` and take an upload in this (metered) loop, from a client in a thread
    with plain sockets (not counted): return the totals with the client's connection still
    open, after it closed, and the bytes the client counted itself."""

    async def get_blob(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(blob)

    async def upload(request: web.Request) -> web.StreamResponse:
        return web.Response(text=str(len(await request.read())))

    app = web.Application()
    app.router.add_get("/blob", get_blob)
    app.router.add_post("/upload", upload)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    meter = loop_meter()
    assert meter is not None
    client = socket.create_connection(("127.0.0.1", port))
    try:

        def talk() -> int:
            head = b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % UPLOAD
            client.sendall(head + b"u" * UPLOAD)
            answer = b""
            while not answer.endswith(b"\r\n\r\n" + str(UPLOAD).encode()):
                answer += client.recv(65536)
            return len(head) + UPLOAD

        sent_by_client = await asyncio.to_thread(talk)
        while_open = meter.totals()
        assert meter.connections == 1
    finally:
        client.close()
    url = f"http://127.0.0.1:{port}/blob"
    async with aiohttp.ClientSession() as session, session.get(url) as answer:
        assert len(await answer.read()) == BLOB
    await runner.cleanup()
    return while_open, meter.totals(), sent_by_client


def test_the_meter_counts_uploads_sendfile_and_open_connections(tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(BLOB))
    with asyncio.Runner(loop_factory=metered_loop) as runner:
        while_open, after, sent_by_client = runner.run(_exchange(blob))
    # the open connection: what the client sent, received by the server, exactly
    assert while_open[1] == sent_by_client
    assert 0 < while_open[0] < 1000  # the answer: a status line, headers and "1000000"
    # then aiohttp's client (in the same loop: both ends counted) fetched the blob with sendfile
    sent, received = after
    assert BLOB <= sent - while_open[0] <= BLOB + 2000
    assert BLOB <= received - while_open[1] <= BLOB + 2000
    # closed connections are kept: nothing goes down
    assert sent >= while_open[0] and received >= while_open[1]


def test_a_loop_without_a_meter_says_so() -> None:
    loop = asyncio.new_event_loop()
    try:
        assert loop_meter(loop) is None
    finally:
        loop.close()
