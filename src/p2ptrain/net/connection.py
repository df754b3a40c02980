"""One WebSocket to one peer: a bounded send queue, rate-limited reads, clean closing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from p2ptrain.errors import ProtocolViolation, TransportError
from p2ptrain.net.config import NetConfig
from p2ptrain.net.limits import TokenBucket
from p2ptrain.net.wire import Bye, encode_frame

__all__ = ["ConnectionStatistics", "PeerConnection", "SlowPeer", "SocketFailed"]

logger = logging.getLogger(__name__)

Socket = aiohttp.ClientWebSocketResponse | web.WebSocketResponse
_SEND_FAILURES = (ConnectionError, aiohttp.ClientError, RuntimeError, TimeoutError)
#: How long a close waits for the peer's close frame.
_CLOSE_S = 2.0


class SlowPeer(Exception):
    """The peer reads too slowly: its send queue is full."""


class SocketFailed(TransportError):
    """The socket broke (no PONG within the heartbeat, a reset): a transport fault, not
    misbehaviour -- the peer may be paused, overloaded or behind a bad link."""


@dataclass(frozen=True, slots=True)
class ConnectionStatistics:
    peer_id: str
    outbound: bool
    frames_in: int
    frames_out: int
    bytes_in: int
    bytes_out: int
    queued: int


class PeerConnection:
    """A peer's socket. ``send`` never blocks (a peer that cannot keep up is dropped);
    ``send_wait`` waits for queue room (bulk relay traffic). ``frames`` yields incoming
    binary frames; a peer that exceeds its rate by more than its burst plus
    ``flood_tolerance_s`` seconds' worth is flooding and is cut off."""

    def __init__(
        self, ws: Socket, peer_id: str, *, outbound: bool, remote: str, config: NetConfig
    ) -> None:
        self.ws = ws
        self.peer_id = peer_id
        self.outbound = outbound
        self.remote = remote
        self.topics: frozenset[str] = frozenset()
        #: Kinds of gossip the peer said it has no use for.
        self.skip: frozenset[str] = frozenset()
        self._config = config
        self._queue: deque[bytes] = deque()
        self._queued_bytes = 0
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        #: Set while every queued frame has been written to the socket.
        self._drained = asyncio.Event()
        self._drained.set()
        self._closed = asyncio.Event()
        self._closing = False
        self._close_done = asyncio.Event()
        #: The reading task's wait in ``receive()``: its scope (None while it waits in none)
        #: and an event set while it waits in none; see ``_take_over_reading``.
        self._receiving: asyncio.Timeout | None = None
        self._not_receiving = asyncio.Event()
        self._not_receiving.set()
        now = time.monotonic()
        self._frames = TokenBucket(config.frames_per_s, config.frame_burst, now)
        self._bytes = TokenBucket(config.bytes_per_s, config.byte_burst, now)
        self.close_reason = ""
        #: The code of the close frame the peer sent (None: it sent none; the socket broke).
        #: Not ``ws.close_code``: that becomes 1006 when our answering close frame cannot be
        #: written because the peer dropped the transport right after its own.
        self.close_code: int | None = None
        self.frames_in = self.frames_out = self.bytes_in = self.bytes_out = 0

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        """Return once the connection is closed (by either side) and its close finished."""
        await self._close_done.wait()

    def send(self, frame: bytes) -> None:
        """Queue a frame; raise SlowPeer when the peer's queue is full."""
        if self.closed:
            return
        if len(self._queue) >= self._config.send_queue_frames:
            raise SlowPeer(f"peer {self.peer_id[:16]} is {len(self._queue)} frames behind")
        self._queue.append(frame)
        self._queued_bytes += len(frame)
        self._drained.clear()
        self._ready.set()
        if self._queued_bytes > self._config.max_frame_bytes * 8:
            self._room.clear()

    async def send_wait(self, frame: bytes, timeout_s: float) -> None:
        """Queue a frame once the queue has room (bounded memory for bulk transfers)."""
        async with asyncio.timeout(timeout_s):
            while not self._room.is_set() and not self.closed:
                await self._room.wait()
        self.send(frame)

    async def write_loop(self) -> None:
        """Drain the queue into the socket until the connection closes."""
        while not self.closed:
            if not self._queue:
                self._ready.clear()
                await self._ready.wait()
                continue
            frame = self._queue.popleft()
            self._queued_bytes -= len(frame)
            if self._queued_bytes <= self._config.max_frame_bytes * 4:
                self._room.set()
            try:
                await self.ws.send_bytes(frame)
            except _SEND_FAILURES:
                # the socket broke: stop sending; the reading side still drains what arrived
                # (the peer's close frame and its code) and the socket's task closes it
                self._closed.set()
                break
            self.frames_out += 1
            self.bytes_out += len(frame)
            if not self._queue:
                self._drained.set()
        self._room.set()
        self._drained.set()

    async def drained(self, timeout_s: float) -> None:
        """Return once every frame queued so far is written to the socket (or it closed);
        raises TimeoutError after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            await self._drained.wait()

    async def frames(self) -> AsyncIterator[bytes]:
        """Incoming binary frames. Raises ProtocolViolation for a text frame, an oversized
        frame, or a peer that floods (see the class docstring); SocketFailed when the socket
        broke (a heartbeat timeout, a reset). Ends once either side closes."""
        while not self._closing:
            message = await self._receive()
            if message is None:  # a close from another task took the socket over
                break
            if message.type == aiohttp.WSMsgType.CLOSE:
                self.close_code = int(message.data)
                if message.data not in (1000, 1001):
                    said = f": {message.extra[:200]}" if message.extra else ""
                    self.close_reason = (
                        self.close_reason or f"closed with code {message.data}{said}"
                    )
                break
            # Once a close began, a frame still handed over is dropped: asking aiohttp's
            # client-side socket for one more message would make it close itself, with 1000,
            # before our close frame (its code and reason) went out.
            if self._closing or message.type in (
                aiohttp.WSMsgType.CLOSING,
                aiohttp.WSMsgType.CLOSED,
            ):
                break
            if message.type == aiohttp.WSMsgType.ERROR:
                raise SocketFailed(f"socket failed: {self.ws.exception()!r:.120}")
            if message.type == aiohttp.WSMsgType.TEXT:
                raise ProtocolViolation("text frames are not part of the protocol")
            if message.type != aiohttp.WSMsgType.BINARY:
                continue
            data: bytes = message.data
            self.frames_in += 1
            self.bytes_in += len(data)
            now = time.monotonic()
            debt_s = max(self._frames.take(1, now), self._bytes.take(len(data), now))
            if debt_s > self._config.flood_tolerance_s:
                raise ProtocolViolation(
                    f"flooding: over the rate limit of {self._config.frames_per_s:.0f} frames/s "
                    f"or {self._config.bytes_per_s / 1e6:.0f} MB/s beyond its burst"
                )
            yield data
        if self.ws.close_code not in (None, 1000, 1001):
            self.close_reason = self.close_reason or f"closed with code {self.ws.close_code}"
        if self.ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
            raise ProtocolViolation("oversized frame")

    async def _receive(self) -> aiohttp.WSMessage | None:
        """The socket's next message; None when ``close`` (from another task) took this
        task out of ``receive()`` to read the peer's close frame itself."""
        scope = asyncio.timeout(None)
        self._receiving = scope
        self._not_receiving.clear()
        try:
            async with scope:
                return await self.ws.receive()
        except TimeoutError:
            if scope.expired():
                return None
            raise
        finally:
            self._receiving = None
            self._not_receiving.set()

    async def close(self, reason: str, *, code: int = aiohttp.WSCloseCode.OK) -> None:
        """Close with ``code`` over the closing handshake: what the peer sends meanwhile is
        read and dropped until its close frame answers ours (``_CLOSE_S`` at most), and
        only then is the transport dropped, so that a peer still writing is not reset
        before it has read the code and the reason. A graceful close (1000) says why first
        (a ``Bye``); a close for misbehaviour sends its close frame at once, its reason in
        the frame, so that the peer reads the code before anything of its own answers. A
        close already under way (from another task: a ban) is waited for, so that the
        socket's own task does not end -- and drop the transport -- before the handshake."""
        if self._closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CLOSE_S + 1.0):
                    await self._close_done.wait()
            return
        self._closing = True
        self.close_reason = reason
        self._closed.set()
        self._ready.set()
        self._room.set()
        try:
            await self._take_over_reading()
            if not self.ws.closed and code == aiohttp.WSCloseCode.OK:
                with contextlib.suppress(*_SEND_FAILURES):
                    await asyncio.wait_for(self.ws.send_bytes(encode_frame(Bye(reason[:500]))), 1.0)
            if not self.ws.closed:
                with contextlib.suppress(*_SEND_FAILURES):
                    message = reason[:100].encode()
                    await asyncio.wait_for(self.ws.close(code=code, message=message), _CLOSE_S)
        finally:
            self._close_done.set()

    async def _take_over_reading(self) -> None:
        """Take the reading task out of ``receive()`` before a server-side socket closes.

        aiohttp's server-side socket, closed while another task waits in its ``receive()``,
        hands that task a CLOSING note, then reads the note as the end of the closing
        handshake and drops the transport right after its own close frame, without reading
        the peer's. A banned peer still sending then gets a reset, and its event loop,
        failing a write, drops the close frame (code and reason) unread: it sees 1006. With
        no task in ``receive()``, ``ws.close()`` reads up to the peer's close frame itself.
        A client-side socket does that handshake either way, and a cancelled ``receive()``
        would mark it 1006 and make its close skip the handshake: it is left alone."""
        if self._receiving is None or not isinstance(self.ws, web.WebSocketResponse):
            return
        self._receiving.reschedule(asyncio.get_running_loop().time())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CLOSE_S):
                await self._not_receiving.wait()

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(
            peer_id=self.peer_id,
            outbound=self.outbound,
            frames_in=self.frames_in,
            frames_out=self.frames_out,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            queued=len(self._queue),
        )
