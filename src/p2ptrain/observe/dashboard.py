"""The live dashboard: one page and its data, served by the node itself.

Routes (:class:`Dashboard`), all read-only, built from the node's own records -- its
status, the window history it keeps (:mod:`.window_history`) and the peers it knows --
never a secret:

* ``GET /`` -- the page (``dashboard_assets/index.html``), its script and style under
  ``/dashboard/``, all shipped in the package (no CDN, no build step);
* ``GET /api/snapshot`` -- one :class:`Snapshot` as JSON;
* ``GET /api/events`` -- server-sent events: a ``snapshot`` event whenever the snapshot
  changed, looked at once a second (at most :data:`MAX_WATCHERS` pages of other machines,
  :data:`MAX_PER_ADDRESS` from one, and :data:`MAX_LOCAL_WATCHERS` of the node's own).

A snapshot (and ``/metrics`` on a listener) is built at most twice a second, whoever asks.

Every serving node adds them to its server (see :mod:`p2ptrain.net.server` for who may ask);
``--metrics-listen HOST:PORT`` serves them with ``/metrics`` on a listener of their own
(:func:`start_listener`), and ``p2ptrain dashboard --dir D`` serves them for any node's data
directory, running or not (:class:`DataDirSnapshots`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
from p2ptrain.net.server import is_loopback
from p2ptrain.observe.status import NodeStatus, read_status
from p2ptrain.observe.telemetry import node_families
from p2ptrain.observe.window_history import HISTORY_FILE, PeerView, WindowRecord, read_history
from p2ptrain.store.atomic import write_atomically

__all__ = [
    "MAX_WATCHERS",
    "PEERS_FILE",
    "Dashboard",
    "DataDirSnapshots",
    "Listener",
    "Snapshot",
    "parse_listen",
    "start_listener",
    "write_peers",
]

PEERS_FILE = "peers.json"
#: Pages of other machines following a node's events at once, and from one address (more
#: are answered 503); pages of the node's own machine (loopback) count apart.
MAX_WATCHERS = 32
MAX_PER_ADDRESS = 4
MAX_LOCAL_WATCHERS = 8
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


@functools.cache
def _asset(name: str) -> bytes:
    return (resources.files("p2ptrain.node") / "dashboard_assets" / name).read_bytes()


class _Fresh:
    """A value built again at most once per :data:`_FRESH_S`, for every asker at once (a
    page, its event stream, every other page and a scraper ask the same node)."""

    def __init__(self, build: Callable[[], bytes]) -> None:
        self._build = build
        self._at = -_FRESH_S
        self._value = b""

    def __call__(self) -> bytes:
        now = time.monotonic()
        if now - self._at >= _FRESH_S:
            self._value, self._at = self._build(), now
        return self._value


class Dashboard:
    """The dashboard's routes over ``snapshot`` (and ``/metrics`` when ``metrics`` is
    given: for a listener of the dashboard's own). :meth:`close` (or leaving it as a context)
    ends the pages' event streams, so that a server stops at once even while a browser
    follows it."""

    def __init__(
        self, snapshot: SnapshotSource, metrics: Callable[[], bytes] | None = None
    ) -> None:
        self._snapshot = _Fresh(lambda: msgspec.json.encode(snapshot()))
        self._metrics = None if metrics is None else _Fresh(metrics)
        self._closing = asyncio.Event()
        self._watchers: dict[str, int] = {}

    def close(self) -> None:
        self._closing.set()

    async def __aenter__(self) -> Dashboard:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """End the event streams (before the server that serves them stops)."""
        self.close()

    def routes(self) -> list[web.RouteDef]:
        routes = [
            web.get("/", self._page),
            web.get("/dashboard/{name}", self._asset),
            web.get("/api/snapshot", self._current),
            web.get("/api/events", self._events),
        ]
        if self._metrics is not None:
            routes.append(web.get("/metrics", self._metrics_page))
        return routes

    async def _page(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_asset("index.html"), content_type="text/html")

    async def _asset(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in _ASSETS or name == "index.html":
            return web.Response(status=404, text=f"no dashboard file {name[:64]!r}\n")
        return web.Response(body=_asset(name), content_type=_ASSETS[name])

    async def _current(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self._snapshot(), content_type="application/json")

    async def _metrics_page(self, request: web.Request) -> web.StreamResponse:
        assert self._metrics is not None
        return web.Response(body=self._metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _admit_watcher(self, remote: str) -> str | None:
        """Why a page at ``remote`` may not follow the events now (None: it may). The
        node's own machine never waits behind strangers."""
        local = is_loopback(remote)
        strangers = sum(n for r, n in self._watchers.items() if not is_loopback(r))
        if not local and strangers >= MAX_WATCHERS:
            return "too many dashboards follow this node"
        if self._watchers.get(remote, 0) >= (MAX_LOCAL_WATCHERS if local else MAX_PER_ADDRESS):
            return "too many dashboards from your address follow this node"
        return None

    async def _events(self, request: web.Request) -> web.StreamResponse:
        remote = request.remote or "?"
        refused = self._admit_watcher(remote)
        if refused is not None or self._closing.is_set():
            return web.Response(status=503, text=f"{refused or 'the node is stopping'}\n")
        self._watchers[remote] = self._watchers.get(remote, 0) + 1
        try:
            async with sse_response(request) as stream:
                last = b""
                # a page that went away ends its stream: not an error worth a line
                with contextlib.suppress(ConnectionResetError):
                    while stream.is_connected() and not self._closing.is_set():
                        data = self._snapshot()
                        if data != last:
                            await stream.send(data.decode(), event="snapshot")
                            last = data
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(_EVENT_EVERY_S):
                                await self._closing.wait()
                return stream
        finally:
            self._watchers[remote] -= 1
            if not self._watchers[remote]:
                del self._watchers[remote]


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
    dashboard: Dashboard

    async def stop(self) -> None:
        self.dashboard.close()
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
    dashboard = Dashboard(snapshot, metrics)
    app.router.add_routes(dashboard.routes())
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
    return Listener(address=f"http://{shown}:{bound[1]}", runner=runner, dashboard=dashboard)


_peers_decoder = msgspec.json.Decoder(list[PeerView])


def write_peers(data_dir: Path, peers: tuple[PeerView, ...]) -> None:
    """The peers a node knows, for a dashboard of its data directory."""
    write_atomically(data_dir / PEERS_FILE, msgspec.json.encode(list(peers)), durable=False)


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
