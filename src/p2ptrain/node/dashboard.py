"""The live dashboard: one page and its data, served by the node itself.

Routes (:func:`dashboard_routes`), all read-only, built from the node's own records -- its
status, the window history it keeps (:mod:`.window_history`) and the peers it knows --
never a secret:

* ``GET /`` -- the page (``dashboard_assets/index.html``), its script and style under
  ``/dashboard/``, all shipped in the package (no CDN, no build step);
* ``GET /api/snapshot`` -- one :class:`Snapshot` as JSON;
* ``GET /api/events`` -- server-sent events: a ``snapshot`` event whenever the snapshot
  changed, looked at once a second (at most :data:`MAX_WATCHERS` pages at once).

Every serving node adds them to its server (see :mod:`p2ptrain.net.server` for who may ask);
``--metrics-listen HOST:PORT`` serves them with ``/metrics`` on a listener of their own
(:func:`start_listener`), and ``p2ptrain dashboard --dir D`` serves them for any node's data
directory, running or not (:class:`DataDirSnapshots`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import msgspec
from aiohttp import web
from aiohttp_sse import sse_response
from prometheus_client import CONTENT_TYPE_LATEST

from p2ptrain.errors import LocalError
from p2ptrain.net.net_metrics import exposition
from p2ptrain.node.status import NodeStatus, read_status
from p2ptrain.node.telemetry import node_families
from p2ptrain.node.window_history import HISTORY_FILE, PeerView, WindowRecord, read_history
from p2ptrain.store.atomic import write_atomically

__all__ = [
    "MAX_WATCHERS",
    "PEERS_FILE",
    "DataDirSnapshots",
    "Listener",
    "Snapshot",
    "dashboard_routes",
    "parse_listen",
    "start_listener",
    "write_peers",
]

logger = logging.getLogger(__name__)

PEERS_FILE = "peers.json"
#: Pages following a node's events at once (more are answered 503).
MAX_WATCHERS = 32
#: How often a page's event stream looks for a changed snapshot.
_EVENT_EVERY_S = 1.0
#: A snapshot is built again for a request at most this often.
_FRESH_S = 0.5
_ASSETS = {
    "index.html": "text/html",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What the dashboard shows: the node's status, the peers it knows, and its window
    history (oldest first)."""

    status: NodeStatus
    peers: tuple[PeerView, ...] = ()
    windows: tuple[WindowRecord, ...] = ()


SnapshotSource = Callable[[], Snapshot]


def _asset(name: str) -> bytes:
    return (resources.files("p2ptrain.node") / "dashboard_assets" / name).read_bytes()


def dashboard_routes(
    snapshot: SnapshotSource, metrics: Callable[[], bytes] | None = None
) -> list[web.RouteDef]:
    """The dashboard's routes over ``snapshot`` (and ``/metrics`` when ``metrics`` is
    given: for a listener of the dashboard's own)."""
    watchers = [0]
    cached: list[tuple[float, bytes]] = []

    def encoded() -> bytes:
        """The snapshot as JSON, built at most once per :data:`_FRESH_S` for everyone
        (a page, its event stream and every other page ask the same node)."""
        now = time.monotonic()
        if not cached or now - cached[0][0] >= _FRESH_S:
            cached[:] = [(now, msgspec.json.encode(snapshot()))]
        return cached[0][1]

    async def page(request: web.Request) -> web.StreamResponse:
        return web.Response(body=_asset("index.html"), content_type="text/html")

    async def asset(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in _ASSETS or name == "index.html":
            return web.Response(status=404, text=f"no dashboard file {name[:64]!r}\n")
        return web.Response(body=_asset(name), content_type=_ASSETS[name])

    async def current(request: web.Request) -> web.StreamResponse:
        return web.Response(body=encoded(), content_type="application/json")

    async def events(request: web.Request) -> web.StreamResponse:
        if watchers[0] >= MAX_WATCHERS:
            return web.Response(status=503, text="too many dashboards follow this node\n")
        watchers[0] += 1
        try:
            async with sse_response(request) as stream:
                last = b""
                # a page that went away ends its stream: not an error worth a line
                with contextlib.suppress(ConnectionResetError):
                    while stream.is_connected():
                        data = encoded()
                        if data != last:
                            await stream.send(data.decode(), event="snapshot")
                            last = data
                        await asyncio.sleep(_EVENT_EVERY_S)
                return stream
        finally:
            watchers[0] -= 1

    routes = [
        web.get("/", page),
        web.get("/dashboard/{name}", asset),
        web.get("/api/snapshot", current),
        web.get("/api/events", events),
    ]
    if metrics is not None:

        async def metrics_page(request: web.Request) -> web.StreamResponse:
            return web.Response(body=metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        routes.append(web.get("/metrics", metrics_page))
    return routes


def parse_listen(where: str, option: str = "--metrics-listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9100`` for IPv6; port 0: any free one) as host and port."""
    host, sep, port = where.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise LocalError(
            f"{option} {where!r}: give HOST:PORT, e.g. 127.0.0.1:9100 (port 0: any free port)"
        )
    return host, int(port)


@dataclass
class Listener:
    """A running listener of the dashboard's own; ``address`` is where it answers."""

    address: str
    runner: web.AppRunner

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_listener(
    where: str,
    snapshot: SnapshotSource,
    metrics: Callable[[], bytes] | None,
    option: str = "--metrics-listen",
) -> Listener:
    """Serve the dashboard (and ``/metrics``) at ``where`` (HOST:PORT), no credentials."""
    host, port = parse_listen(where, option)
    app = web.Application()
    app.router.add_routes(dashboard_routes(snapshot, metrics))
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise LocalError(
            f"{option} {where}: cannot listen there ({exc.strerror or exc}); pick another "
            "port, or port 0 for any free one"
        ) from exc
    bound = runner.addresses[0]
    shown = f"[{bound[0]}]" if ":" in str(bound[0]) else str(bound[0])
    return Listener(address=f"http://{shown}:{bound[1]}", runner=runner)


_peers_decoder = msgspec.json.Decoder(list[PeerView])


def write_peers(data_dir: Path, peers: tuple[PeerView, ...]) -> None:
    """The peers a node knows, for a dashboard of its data directory."""
    write_atomically(data_dir / PEERS_FILE, msgspec.json.encode(list(peers)))


class DataDirSnapshots:
    """Snapshots read from a node's data directory (``p2ptrain dashboard --dir``): its
    status file, window history and peers, as the node last wrote them."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        read_status(data_dir)  # refuses a directory that is no node's, with the reason

    def __call__(self) -> Snapshot:
        status = read_status(self.data_dir)
        peers: list[PeerView] = []
        with contextlib.suppress(FileNotFoundError, OSError, msgspec.DecodeError):
            peers = _peers_decoder.decode((self.data_dir / PEERS_FILE).read_bytes())
        return Snapshot(
            status=status,
            peers=tuple(peers),
            windows=tuple(read_history(self.data_dir / HISTORY_FILE)),
        )

    def metrics(self) -> bytes:
        """The status file's figures as Prometheus text (no histograms: those live in the
        running node)."""
        status = read_status(self.data_dir)
        return exposition(lambda: list(node_families(status)))
