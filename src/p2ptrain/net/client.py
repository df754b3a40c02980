"""The HTTP side of talking to peers: authenticated requests, records and blob pushes.

Every request is signed (see :mod:`p2ptrain.net.auth`). The first request to a peer gets a
``401`` with a nonce; the nonce is cached per peer address and a request that finds it stale
is retried once with the new one. Answers from peers are untrusted: records are decoded with
size limits and verified by signature, heads by certificate (by the caller's chain).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.encoding import decode
from p2ptrain.core.envelope import Envelope, Signed, verify_envelope
from p2ptrain.core.records import Head, PeerRecord
from p2ptrain.errors import LocalError, ProtocolViolation, TransportError
from p2ptrain.net.auth import NONCE_TTL_MS, SERVER_HEADER, ClientCredentials, nonce_from_challenge
from p2ptrain.net.failure_text import transport_reason

__all__ = [
    "BLOB_ID_HEADER",
    "NETWORK_PATH",
    "HeadLinks",
    "PeerClient",
    "PeerRecords",
    "Refused",
    "WindowRecords",
    "fetch_network_manifest",
    "pinned_ssl",
]

logger = logging.getLogger(__name__)

BLOB_ID_HEADER = "P2PTrain-Blob-Id"
MAX_PEER_RECORDS_BYTES = 8 << 20
MAX_HEAD_LINKS_BYTES = 64 << 20
MAX_RECORD_BYTES = 64 << 20
#: Ids a window answer may name (each 64 hex digits), and its size.
MAX_WINDOW_IDS = 1024
MAX_WINDOW_RECORDS_BYTES = 80 * MAX_WINDOW_IDS
#: The signed network manifest, served without credentials (a newcomer needs it to sign).
NETWORK_PATH = "/v1/network"


class PeerRecords(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``GET /v1/peers``: signed peer records, the answering peer's own first."""

    records: list[Envelope]


class HeadLinks(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``GET /v1/heads/{experiment}?after=H``: a page of the certified heads above ``H``, in
    order (at most :data:`~p2ptrain.protocol.chain.MAX_LINKS_PER_PAGE`), the answering
    node's height (``tip``: more pages follow while the links end below it), and the heights
    among its newest heads whose blobs it holds (``held``)."""

    links: list[tuple[Head, QuorumCertificate]]
    tip: int = 0
    held: list[int] = msgspec.field(default_factory=list)


class WindowRecords(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``GET /v1/window/{experiment}/{window}``: the ids of the updates and proposals of
    the window the node keeps (anti-entropy: a peer fetches the ones it lacks by id)."""

    updates: list[str]
    proposals: list[str]


class Refused(TransportError):
    """A peer refused us at the door (wrong secret, no certificate, banned, full)."""

    def __init__(self, address: str, status: int, reason: str) -> None:
        super().__init__(f"{address} refused us ({status}): {reason}")
        self.address = address
        self.status = status
        self.reason = reason


def pinned_ssl(address: str) -> aiohttp.Fingerprint | bool:
    """TLS settings for an address: ``https://host:port#sha256=<hex>`` pins the server's
    certificate fingerprint (self-signed certificates named in signed peer records)."""
    parts = urlsplit(address)
    if parts.scheme != "https":
        return True
    if parts.fragment.startswith("sha256="):
        try:
            return aiohttp.Fingerprint(bytes.fromhex(parts.fragment[7:]))
        except ValueError as exc:
            raise LocalError(f"bad certificate pin in {address!r}: {exc}") from None
    return True


def origin_of(address: str) -> str:
    parts = urlsplit(address)
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True, slots=True)
class _Nonce:
    value: str
    fetched: float


class PeerClient:
    """Signed HTTP requests to peers over one shared aiohttp session."""

    def __init__(self, credentials: ClientCredentials, *, timeout_s: float = 30.0) -> None:
        self.credentials = credentials
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeout_s, sock_read=timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        self._nonces: dict[str, _Nonce] = {}
        #: Blob bytes uploaded to peers (``push_blob``).
        self.bytes_pushed = 0

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=16, enable_cleanup_closed=True)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def authorization(self, address: str, method: str, path: str) -> tuple[dict[str, str], bytes]:
        """Headers that authenticate one request to ``address`` (empty without a nonce yet),
        and the client nonce used."""
        nonce = self._nonces.get(origin_of(address))
        if nonce is None or (time.monotonic() - nonce.fetched) * 1000 > NONCE_TTL_MS / 2:
            return {}, b""
        header, cnonce = self.credentials.header(nonce.value, method, path)
        return {"Authorization": header}, cnonce

    def learn_nonce(self, address: str, challenge: str | None) -> bool:
        nonce = nonce_from_challenge(challenge)
        if nonce is None:
            return False
        self._nonces[origin_of(address)] = _Nonce(nonce, time.monotonic())
        return True

    @asynccontextmanager
    async def request(
        self,
        method: str,
        address: str,
        path: str,
        *,
        headers: Mapping[str, str] | None = None,
        data: Any = None,
        ok: tuple[int, ...] = (200, 206),
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One signed request; yields the response when its status is in ``ok``. Raises
        :class:`Refused` for 403/429/503 and TransportError for anything else."""
        path = urlsplit(address).path.rstrip("/") + path  # a relay address has a path prefix
        url = origin_of(address) + path
        for attempt in range(2):
            auth, _ = self.authorization(address, method, path)
            try:
                response = await self.session.request(
                    method,
                    url,
                    headers={**(headers or {}), **auth},
                    data=data,
                    ssl=pinned_ssl(address),
                    allow_redirects=False,
                )
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise TransportError(f"{method} {url} failed: {transport_reason(exc)}") from exc
            try:
                challenge = response.headers.get("WWW-Authenticate")
                retry = response.status == 401 and attempt == 0 and data is None
                if retry and self.learn_nonce(address, challenge):
                    continue
                if response.status not in ok:
                    reason = await _reason(response)
                    if response.status in (401, 403, 429, 503):
                        raise Refused(address, response.status, reason)
                    raise TransportError(f"{method} {url}: {response.status} {reason}")
                yield response
                return
            finally:
                response.release()

    async def ensure_nonce(self, address: str) -> None:
        """Make sure we hold a fresh nonce for ``address`` (before a streamed upload)."""
        if self.authorization(address, "HEAD", "/v1/peers")[0]:
            return
        async with self.request("HEAD", address, "/v1/peers"):
            pass

    async def peer_records(self, address: str) -> list[Signed[PeerRecord]]:
        """The verified peer records ``address`` knows, its own first. Records that fail to
        verify are skipped; a malformed answer raises ProtocolViolation."""
        async with self.request("GET", address, "/v1/peers") as response:
            body = await _read_limited(response, MAX_PEER_RECORDS_BYTES)
        answer = decode(PeerRecords, body, max_bytes=MAX_PEER_RECORDS_BYTES)
        verified = []
        for envelope in answer.records:
            try:
                verified.append(verify_envelope(envelope, PeerRecord))
            except ProtocolViolation as exc:
                logger.info("skipping a peer record from %s: %s", address, exc)
        return verified

    async def head_links(self, address: str, experiment_id: str, after: int) -> HeadLinks:
        """A page of the certified heads above ``after`` as ``address`` tells them:
        unverified, the receiving chain checks every link (:meth:`HeadChain.extend_links`)."""
        path = f"/v1/heads/{experiment_id}?after={after}"
        async with self.request("GET", address, path) as response:
            body = await _read_limited(response, MAX_HEAD_LINKS_BYTES)
        return decode(HeadLinks, body, max_bytes=MAX_HEAD_LINKS_BYTES)

    async def record(self, address: str, record_id: str) -> bytes:
        """The signed envelope stored under ``record_id`` at ``address``: unverified, the
        caller opens it and checks its id."""
        async with self.request("GET", address, f"/v1/records/{record_id}") as response:
            return await _read_limited(response, MAX_RECORD_BYTES)

    async def window_records(self, address: str, experiment_id: str, window: int) -> WindowRecords:
        """Which updates and proposals of ``window`` ``address`` keeps (ids, checked for
        form; the records themselves are fetched by id and verified)."""
        path = f"/v1/window/{experiment_id}/{window}"
        async with self.request("GET", address, path) as response:
            body = await _read_limited(response, MAX_WINDOW_RECORDS_BYTES)
        answer = decode(WindowRecords, body, max_bytes=MAX_WINDOW_RECORDS_BYTES)
        ids = [*answer.updates, *answer.proposals]
        if len(ids) > MAX_WINDOW_IDS or not all(_is_id(i) for i in ids):
            raise ProtocolViolation(f"{address} named malformed or too many record ids")
        return answer

    async def has_blob(self, address: str, blob_id: str) -> int | None:
        """The size of ``blob_id`` at ``address``, or None when it does not hold it."""
        async with self.request("HEAD", address, f"/v1/blobs/{blob_id}", ok=(200, 404)) as r:
            return r.content_length if r.status == 200 else None

    async def push_blob(self, address: str, blob_id: str, path: Path) -> bool:
        """Upload a stored blob to a reachable peer (trainers behind NAT publish this way).
        Returns False when the peer already had it."""
        if await self.has_blob(address, blob_id) is not None:
            return False
        size = path.stat().st_size
        with path.open("rb") as source:
            async with self.request(
                "POST",
                address,
                "/v1/blobs",
                headers={BLOB_ID_HEADER: blob_id, "Content-Length": str(size)},
                data=_file_chunks(source),
                ok=(200, 201),
            ):
                pass
        self.bytes_pushed += size
        return True

    async def open_socket(
        self, address: str, *, max_frame_bytes: int, timeout_s: float, heartbeat_s: float = 20.0
    ) -> tuple[aiohttp.ClientWebSocketResponse, str]:
        """Open the gossip WebSocket to ``address``; return it and the server's proven peer id.
        A 401 on the upgrade (the server restarted and forgot our nonce) teaches the new
        nonce, and the upgrade is asked for once more."""
        url = origin_of(address).replace("http", "ws", 1) + "/ws"
        for attempt in range(2):
            await self.ensure_nonce(address)
            auth, cnonce = self.authorization(address, "GET", "/ws")
            try:
                ws = await asyncio.wait_for(
                    self.session.ws_connect(
                        url,
                        headers=auth,
                        max_msg_size=max_frame_bytes,
                        heartbeat=heartbeat_s,
                        autoping=True,
                        ssl=pinned_ssl(address),
                    ),
                    timeout_s,
                )
            except aiohttp.WSServerHandshakeError as exc:
                challenge = None if exc.headers is None else exc.headers.get("WWW-Authenticate")
                if exc.status == 401 and attempt == 0 and self.learn_nonce(address, challenge):
                    continue
                raise Refused(address, exc.status, exc.message) from exc
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise TransportError(
                    f"cannot open a socket to {address}: {transport_reason(exc)}"
                ) from exc
            break
        try:
            peer_id = self.credentials.check_server(ws._response.headers.get(SERVER_HEADER), cnonce)
        except ProtocolViolation:
            await ws.close()
            raise
        return ws, peer_id


async def fetch_network_manifest(address: str, *, timeout_s: float = 30.0) -> bytes:
    """The signed network manifest envelope ``address`` serves (no credentials needed).
    Untrusted: the caller checks it against an experiment or network id it already knows."""
    url = origin_of(address) + urlsplit(address).path.rstrip("/") + NETWORK_PATH
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url, ssl=pinned_ssl(address)) as response,
        ):
            if response.status != 200:
                reason = await _reason(response)
                raise TransportError(f"GET {url}: {response.status} {reason}")
            return await _read_limited(response, 1 << 20)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise TransportError(f"cannot reach {address}: {transport_reason(exc)}") from exc


def _is_id(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


async def _file_chunks(source: Any) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(source.read, 1 << 20):
        yield chunk


async def _read_limited(response: aiohttp.ClientResponse, limit: int) -> bytes:
    if response.content_length is not None and response.content_length > limit:
        raise ProtocolViolation(f"answer of {response.content_length} bytes exceeds {limit}")
    body = bytearray()
    try:
        async for chunk in response.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise ProtocolViolation(f"answer exceeds {limit} bytes")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:  # stalled or cut off
        raise TransportError(
            f"reading the answer of {response.url} failed: {transport_reason(exc)}"
        ) from exc
    return bytes(body)


async def _reason(response: aiohttp.ClientResponse) -> str:
    if reason := response.headers.get("P2PTrain-Reason"):
        return reason
    try:
        text = (await response.content.read(1024)).decode(errors="replace")
    except (aiohttp.ClientError, TimeoutError):
        return response.reason or ""
    return text.strip() or (response.reason or "")
