"""The dashboard's routes on an in-process aiohttp server: the page and its files, the
snapshot, the event stream, ``/metrics`` and the listener's address rules."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from aiohttp.web import Application
from prometheus_client.parser import text_string_to_metric_families

from p2ptrain.core.manifests import NetworkManifest, secret_check
from p2ptrain.errors import LocalError
from p2ptrain.net.net_metrics import exposition
from p2ptrain.net.node import NetNode
from p2ptrain.net.server import REASON_HEADER, NodeServer
from p2ptrain.observe.dashboard import (
    MAX_LOCAL_WATCHERS,
    Dashboard,
    Snapshot,
    parse_listen,
    start_listener,
)
from p2ptrain.observe.status import NodeStatus
from p2ptrain.observe.telemetry import node_families
from p2ptrain.store.blobs import BlobStore
from tests.support.builders import identity

SECRET = b"a network secret of 32 bytes...."


def _status(height: int) -> NodeStatus:
    return NodeStatus(
        peer_id="p" * 64,
        roles=("seed",),
        address=None,
        experiment_id="e" * 64,
        height=height,
        head_id="h" * 64,
        adopted_head_id="h" * 64,
        windows_certified=height,
    )


def test_the_page_its_files_the_snapshot_and_its_events() -> None:
    heights = iter(range(1, 1000))
    status = [_status(next(heights))]

    def snapshot() -> Snapshot:
        return Snapshot(status=status[0])

    def metrics() -> bytes:
        return exposition(lambda: list(node_families(status[0])))

    async def scenario() -> dict[str, object]:
        app = Application()
        app.router.add_routes(Dashboard(snapshot, metrics).routes())
        seen: dict[str, object] = {}
        async with TestClient(TestServer(app)) as client:
            page = await client.get("/")
            seen["page"] = (page.status, page.content_type, await page.text())
            script = await client.get("/dashboard/dashboard.js")
            seen["script"] = (script.status, script.content_type)
            missing = await client.get("/dashboard/../../etc/passwd")
            seen["missing"] = missing.status
            unknown = await client.get("/dashboard/secret.txt")
            seen["unknown"] = unknown.status
            answer = await client.get("/api/snapshot")
            seen["snapshot"] = json.loads(await answer.text())
            text = await (await client.get("/metrics")).text()
            seen["metrics"] = {f.name: f.type for f in text_string_to_metric_families(text)}
            events = await client.get("/api/events")
            seen["events_type"] = events.content_type
            first = await asyncio.wait_for(events.content.readuntil(b"\r\n\r\n"), 10)
            status[0] = _status(next(heights) + 41)  # the node moved on: a new event follows
            second = await asyncio.wait_for(events.content.readuntil(b"\r\n\r\n"), 10)
            seen["events"] = [first.decode(), second.decode()]
            events.close()
        return seen

    seen = asyncio.run(scenario())
    status_code, content_type, body = seen["page"]  # type: ignore[misc]
    assert (status_code, content_type) == (200, "text/html")
    assert "/dashboard/dashboard.js" in body and "viewport" in body
    assert seen["script"] == (200, "text/javascript")
    assert seen["missing"] == 404 and seen["unknown"] == 404
    assert seen["snapshot"]["status"]["height"] == 1  # type: ignore[index]
    assert seen["metrics"]["p2ptrain_windows_certified"] == "counter"  # type: ignore[index]
    assert seen["events_type"] == "text/event-stream"
    first, second = seen["events"]  # type: ignore[misc]
    assert first.startswith("event: snapshot\r\n") and '"height":1' in first
    assert '"height":43' in second


@pytest.mark.parametrize("where", ["9100", "localhost", "host:port", ":80", "h:99999"])
def test_a_listen_address_is_host_and_port(where: str) -> None:
    with pytest.raises(LocalError, match="give HOST:PORT"):
        parse_listen(where)


def test_listen_addresses_parse() -> None:
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen("[::1]:9100") == ("::1", 9100)


def test_a_port_in_use_is_refused_with_what_to_do() -> None:
    async def scenario() -> str:
        first = await start_listener("127.0.0.1:0", lambda: Snapshot(status=_status(1)), None)
        try:
            port = first.address.rsplit(":", 1)[1]
            with pytest.raises(LocalError) as refused:
                await start_listener(f"127.0.0.1:{port}", lambda: Snapshot(status=_status(1)), None)
            return str(refused.value)
        finally:
            await first.stop()

    message = asyncio.run(scenario())
    assert "--metrics-listen" in message and "cannot listen there" in message


@pytest.mark.parametrize(
    ("private", "remote", "host", "expected"),
    [
        (False, "10.0.0.5", "node.example:7700", 200),  # an open network: to anyone
        (True, "127.0.0.1", "127.0.0.1:7700", 200),  # a private one: to the node's machine
        (True, "127.0.0.1", "localhost:7700", 200),
        (True, "10.0.0.5", "node.example:7700", 401),  # anyone else proves the secret
        (True, "127.0.0.1", "rebound.example:7700", 401),  # a page whose name rebinds
    ],
)
def test_who_sees_the_dashboard_of_a_node(
    tmp_path: Path, private: bool, remote: str, host: str, expected: int
) -> None:
    network = NetworkManifest(
        name="dash",
        authority=identity(900).public_key,
        secret_check=secret_check(SECRET) if private else None,
    )
    net = NetNode(
        identity=identity(1),
        network=network,
        blobs=BlobStore(tmp_path / "blobs"),
        secret=SECRET if private else None,
    )
    page = web.get("/", lambda request: _ok())
    server = NodeServer(
        net.config,
        gatekeeper=net.gatekeeper,
        content=net.content,
        peers=net.peers,
        relay=net.relay,
        connection_to=lambda _: None,
        on_socket=lambda *_: _nothing(),
        inbound_full=lambda: False,
        metrics=lambda: b"",
        extra_routes=[page],
    )
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (remote, 40000) if name == "peername" else default
    )
    request = make_mocked_request("GET", "/", headers={"Host": host}, transport=transport)

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(text="the page")

    answer = asyncio.run(server._guard(request, handler))
    assert answer.status == expected
    if expected == 401:
        assert "--metrics-listen" in answer.headers[REASON_HEADER]


async def _ok() -> web.StreamResponse:
    return web.Response(text="ok")


async def _nothing() -> None:
    return None


def test_event_streams_are_capped_and_end_when_the_dashboard_closes() -> None:
    dashboard = Dashboard(lambda: Snapshot(status=_status(1)))

    async def scenario() -> tuple[list[int], bytes, float]:
        app = Application()
        app.router.add_routes(dashboard.routes())
        async with TestClient(TestServer(app)) as client:
            streams = [await client.get("/api/events") for _ in range(MAX_LOCAL_WATCHERS + 1)]
            statuses = [s.status for s in streams]
            open_streams = [s for s in streams if s.status == 200]
            await asyncio.wait_for(open_streams[0].content.readuntil(b"\r\n\r\n"), 10)
            started = asyncio.get_running_loop().time()
            dashboard.close()  # the node stops: every stream ends, none waits for its page
            rest = await asyncio.wait_for(open_streams[0].content.read(), 10)
            ended = asyncio.get_running_loop().time() - started
            for stream in streams:
                stream.close()
        return statuses, rest, ended

    statuses, rest, ended = asyncio.run(scenario())
    assert statuses == [200] * MAX_LOCAL_WATCHERS + [503]  # loopback: its own cap
    assert rest == b"" and ended < 5
