"""The node's HTTP server (aiohttp): blobs, records, the gossip socket and the relay.

Routes (all but ``/metrics`` need credentials, see :mod:`p2ptrain.net.auth`):

* ``GET/HEAD /v1/blobs/{id}`` -- a blob, with ``Range`` (sent with ``sendfile``);
* ``POST /v1/blobs`` -- a peer pushes a blob: ``P2PTrain-Blob-Id`` and ``Content-Length``
  are required; the bytes are streamed to disk, hashed, and stored only if they hash to the
  id;
* ``GET /v1/peers`` -- signed peer records; ``GET /v1/heads/{experiment}?after=H`` -- the
  certified head chain above height H;
* ``GET /ws`` -- the gossip WebSocket;
* ``GET /v1/relay/{peer id}/v1/...`` -- the same requests, answered by a private peer
  connected to this node;
* ``GET /metrics`` -- Prometheus text, from loopback only (``--metrics-listen`` serves it
  elsewhere, on a listener of its own);
* the routes a node adds (:attr:`NodeServer.extra_routes`: the dashboard), answered without
  credentials to loopback callers, and to everyone on an open network; a private network's
  peers prove its secret as on every other route.

Bad requests are answered with a status and a one-line reason, counted against the caller's
address (or peer id once known), and never disturb other requests.
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST

from p2ptrain.errors import BlobNotFound, ProtocolViolation, TransportError
from p2ptrain.net.auth import SERVER_HEADER, Admitted, Gatekeeper, Refusal
from p2ptrain.net.client import BLOB_ID_HEADER, NETWORK_PATH
from p2ptrain.net.config import NetConfig
from p2ptrain.net.connection import PeerConnection
from p2ptrain.net.content import LocalContent, parse_range
from p2ptrain.net.limits import TokenBucket
from p2ptrain.net.peers import PeerBook
from p2ptrain.net.relay import RelayHub
from p2ptrain.store.blobs import validate_blob_id

__all__ = ["NodeServer", "ServerStatistics", "is_loopback"]

logger = logging.getLogger(__name__)

#: The caller admitted by the guard, for the handler it calls (same task, same context).
_ADMITTED: contextvars.ContextVar[Admitted] = contextvars.ContextVar("admitted")
_REFUSALS_PER_S = 20.0
_REFUSAL_BURST = 100
#: Answered without credentials: metrics (loopback only, see its handler) and the signed
#: network manifest, which a newcomer needs before it can sign a request.
_PUBLIC_PATHS = frozenset({"/metrics", NETWORK_PATH})
_PRIVATE_DASHBOARD = (
    "this network is private: its dashboard answers loopback callers of the node, or run the "
    "node with --metrics-listen HOST:PORT and open that address"
)


class _QuietPeerFaults(logging.Filter):
    """aiohttp logs a request it could not parse (a request line over its 8190 bytes, a
    malformed header) or that broke off mid-way with a traceback at ERROR. Those are a
    peer's fault, not ours: one WARNING line naming the peer, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError | ConnectionError | aiohttp.ClientError):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg, record.args, record.exc_info = (
                "bad request from %s: %s",
                (
                    remote,
                    (str(error).strip().splitlines() or [type(error).__name__])[-1][:200],
                ),
                None,
            )
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_QUIET = _QuietPeerFaults()
logging.getLogger("aiohttp.server").addFilter(_QUIET)


@dataclass(frozen=True, slots=True)
class ServerStatistics:
    requests: int
    refused: int
    bad_requests: int
    blobs_served: int
    blobs_received: int
    bytes_received: int


REASON_HEADER = "P2PTrain-Reason"


def _reply(status: int, reason: str, headers: dict[str, str] | None = None) -> web.Response:
    """A short answer; the reason is also in a header, so HEAD requests carry it too."""
    headers = {**(headers or {}), REASON_HEADER: reason[:300].encode("ascii", "replace").decode()}
    return web.Response(status=status, text=reason + "\n", headers=headers)


class NodeServer:
    """Builds the aiohttp application; the node owns the runner and the sockets."""

    def __init__(
        self,
        config: NetConfig,
        *,
        gatekeeper: Gatekeeper,
        content: LocalContent,
        peers: PeerBook,
        relay: RelayHub,
        connection_to: Callable[[str], PeerConnection | None],
        on_socket: Callable[[web.WebSocketResponse, Admitted, str], Awaitable[None]],
        inbound_full: Callable[[], bool],
        metrics: Callable[[], bytes],
        on_blob_bytes: Callable[[str, str, int], None] | None = None,
        extra_routes: Sequence[web.RouteDef] = (),
    ) -> None:
        """``metrics``: the Prometheus text of ``/metrics``; ``on_blob_bytes(direction,
        blob_id, n)``: told of each blob served (``sent``) or pushed here (``received``);
        ``extra_routes``: the node's own pages (see the module docstring)."""
        self.config = config
        self.gatekeeper = gatekeeper
        self.content = content
        self.peers = peers
        self.relay = relay
        self._connection_to = connection_to
        self._on_socket = on_socket
        self._inbound_full = inbound_full
        self._metrics = metrics
        self._on_blob_bytes = on_blob_bytes or (lambda *_: None)
        self.extra_routes = tuple(extra_routes)
        self._extra_paths = {route.path for route in self.extra_routes}
        self._private = gatekeeper.private
        self._buckets: dict[str, TokenBucket] = {}
        self._refusals: dict[str, TokenBucket] = {}
        self._requests = self._refused = self._bad = 0
        self._served = self._received = self._received_bytes = 0

    def application(self) -> web.Application:
        app = web.Application(
            middlewares=[self._guard],
            client_max_size=self.config.max_upload_bytes + 1,
            handler_args={"max_field_size": 8190, "max_line_size": 8190},
        )
        app.router.add_get("/metrics", self._metrics_page)
        app.router.add_routes(self.extra_routes)
        app.router.add_get("/ws", self._socket)
        app.router.add_post("/v1/blobs", self._upload)
        app.router.add_get(r"/v1/blobs/{blob_id}", self._blob)
        app.router.add_get(r"/v1/relay/{peer_id:[0-9a-f]{64}}/{rest:.*}", self._relayed)
        app.router.add_get(r"/v1/{rest:.*}", self._record)
        return app

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(
            requests=self._requests,
            refused=self._refused,
            bad_requests=self._bad,
            blobs_served=self._served,
            blobs_received=self._received,
            bytes_received=self._received_bytes,
        )

    # -- the door -------------------------------------------------------------------------

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        self._requests += 1
        remote = request.remote or "?"
        now = time.monotonic()
        if request.path in _PUBLIC_PATHS:
            return await handler(request)
        if self._is_extra(request.path) and (
            not self._private or (is_loopback(remote) and _names_loopback(request.host))
        ):
            return await handler(request)
        refusals = self._refusals.get(remote)
        if refusals is not None and refusals.take(0, now) > 0:
            self._refused += 1
            return _reply(429, "too many refused requests from this address; slow down")
        try:
            admitted = self.gatekeeper.admit(
                request.headers.get("Authorization"), request.method, request.path_qs
            )
        except ProtocolViolation as exc:
            status = exc.status if isinstance(exc, Refusal) else 400
            self._refused += 1
            if status == 401 and isinstance(exc, Refusal):
                challenge = self.gatekeeper.challenge_header(exc.nonce)
                reason = exc.reason
                if self._is_extra(request.path):  # a person's browser, most likely
                    reason += f"; {_PRIVATE_DASHBOARD}"
                return _reply(401, reason, {"WWW-Authenticate": challenge})
            self._count_refusal(remote, now)
            logger.warning("refused %s %s from %s: %s", request.method, request.path, remote, exc)
            return _reply(status, f"refused: {exc}")
        if self.peers.banned(admitted.peer_id, now):
            self._refused += 1
            return _reply(403, "banned for misbehaving; try again later")
        bucket = self._buckets.get(admitted.peer_id)
        if bucket is None:
            if len(self._buckets) > 100_000:
                self._buckets.clear()
            bucket = TokenBucket(self.config.requests_per_s, self.config.request_burst, now)
            self._buckets[admitted.peer_id] = bucket
        wait = bucket.take(1, now)
        if wait > 0:
            self._refused += 1
            return _reply(429, "too many requests", {"Retry-After": str(max(1, round(wait)))})
        _ADMITTED.set(admitted)
        return await handler(request)

    def _is_extra(self, path: str) -> bool:
        return path in self._extra_paths or any(
            p.endswith("}") and path.startswith(p[: p.index("{")]) for p in self._extra_paths
        )

    def _count_refusal(self, remote: str, now: float) -> None:
        """Refused requests cost us a signature check each: an address that keeps sending
        them is answered 429 without checking, until its bucket refills."""
        bucket = self._refusals.get(remote)
        if bucket is None:
            if len(self._refusals) > 100_000:
                self._refusals.clear()
            bucket = TokenBucket(_REFUSALS_PER_S, _REFUSAL_BURST, now)
            self._refusals[remote] = bucket
        bucket.take(1, now)

    # -- handlers -------------------------------------------------------------------------

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        try:
            blob_id = validate_blob_id(request.match_info["blob_id"])
        except ProtocolViolation as exc:
            self._bad += 1
            return _reply(400, str(exc))
        try:
            path = self.content.blobs.path(blob_id)
        except BlobNotFound:
            return _reply(404, f"this node does not hold blob {blob_id}")
        self._served += 1
        served = _served_bytes(request, path.stat().st_size)
        self._on_blob_bytes("sent", blob_id, served)
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})

    async def _record(self, request: web.Request) -> web.StreamResponse:
        # Blobs have their own route (sendfile); records are small bytes answers.
        answer = self.content.answer(request.method, request.path_qs)
        return web.Response(status=answer.status, body=answer.body, headers=answer.headers)

    async def _upload(self, request: web.Request) -> web.StreamResponse:
        admitted = _ADMITTED.get()
        try:
            blob_id = validate_blob_id(request.headers.get(BLOB_ID_HEADER))
        except ProtocolViolation as exc:
            self._bad += 1
            return _reply(400, f"{BLOB_ID_HEADER}: {exc}")
        size = request.content_length
        if size is None:
            return _reply(411, "Content-Length is required to push a blob")
        if size > self.config.max_upload_bytes:
            return _reply(413, f"blob of {size} bytes exceeds this node's limit")
        if self.content.blobs.has(blob_id):
            return _reply(200, "already held")
        loop = asyncio.get_running_loop()

        def chunks() -> Iterator[bytes]:
            while True:
                chunk = asyncio.run_coroutine_threadsafe(request.content.readany(), loop).result()
                if not chunk:
                    return
                yield chunk

        try:
            await asyncio.to_thread(
                self.content.blobs.put_stream, chunks(), expected_id=blob_id, max_bytes=size
            )
        except (HttpProcessingError, ConnectionError, aiohttp.ClientError) as exc:
            # the uploader went away mid-way: a transport fault, nothing kept
            logger.warning(
                "upload of blob %s from %s broke off: %s",
                blob_id[:16],
                admitted.peer_id[:16],
                str(exc).strip() or type(exc).__name__,
            )
            return _reply(400, "the upload broke off")
        except OSError as exc:
            logger.warning(
                "cannot store blob %s pushed by %s: %s", blob_id[:16], admitted.peer_id[:16], exc
            )
            return _reply(507, f"this node cannot store the blob now: {exc.strerror or exc}")
        except ProtocolViolation as exc:
            self._bad += 1
            self.peers.strike(admitted.peer_id, f"pushed a bad blob: {exc}", time.monotonic())
            return _reply(400, str(exc))
        self._received += 1
        self._received_bytes += size
        self._on_blob_bytes("received", blob_id, size)
        return _reply(201, "stored")

    async def _socket(self, request: web.Request) -> web.StreamResponse:
        admitted = _ADMITTED.get()
        if self._inbound_full():
            return _reply(503, "this node has all the inbound connections it takes")
        ws = web.WebSocketResponse(
            max_msg_size=self.config.max_frame_bytes,
            heartbeat=self.config.heartbeat_s,
            timeout=2.0,
            compress=False,
        )
        ws.headers[SERVER_HEADER] = self.gatekeeper.server_proof(admitted.cnonce)
        await ws.prepare(request)
        await self._on_socket(ws, admitted, request.remote or "?")
        return ws

    async def _relayed(self, request: web.Request) -> web.StreamResponse:
        connection = self._connection_to(request.match_info["peer_id"])
        if connection is None:
            return _reply(503, "that peer is not connected to this relay now; try later")
        target = "/" + request.match_info["rest"]
        if request.query_string:
            target += "?" + request.query_string
        try:
            head, body = await self.relay.forward(
                connection, request.method, target, request.headers.get("Range")
            )
        except TransportError as exc:
            return _reply(502, str(exc))
        response = web.StreamResponse(status=head.status, headers=head.headers)
        await response.prepare(request)
        try:
            async for chunk in body:
                await response.write(chunk)
        except TransportError as exc:
            logger.info("relay to %s broke off: %s", connection.peer_id[:16], exc)
            raise ConnectionResetError(str(exc)) from exc
        await response.write_eof()
        return response

    async def _metrics_page(self, request: web.Request) -> web.StreamResponse:
        if not is_loopback(request.remote):
            return _reply(403, "metrics are served to loopback only")
        return web.Response(body=self._metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _served_bytes(request: web.Request, size: int) -> int:
    """The bytes a GET of a ``size``-byte file answers (its range; none for HEAD or a range
    it cannot satisfy)."""
    if request.method != "GET":
        return 0
    try:
        wanted = parse_range(request.headers.get("Range"), size)
    except ValueError:
        return 0
    return size if wanted is None else wanted[1] - wanted[0]


def _names_loopback(host: str) -> bool:
    """Whether a request's ``Host`` names this machine (a page another site's name resolved
    to 127.0.0.1 does not: DNS rebinding)."""
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.split("]")[0].removeprefix("[") if name.startswith("[") else name
    return name == "localhost" or is_loopback(name)


def is_loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False
