"""Relaying requests to private peers through the WebSocket they keep open to a seed.

A peer with no inbound route (behind NAT, or choosing not to listen) names a seed as its
``relay`` in its peer record and keeps a gossip connection to it. A request for
``{seed}/v1/relay/{peer id}/v1/...`` reaches the seed, which sends a :class:`RelayRequest`
frame over that connection; the private peer answers with a :class:`RelayHead` and
:class:`RelayChunk` frames from its own :class:`LocalContent`, and the seed streams them on.
Relayed bytes are not trusted: blobs are hash-checked and records signature-checked by
whoever asked, exactly as if they had come directly.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

from p2ptrain.errors import ProtocolViolation, TransportError
from p2ptrain.net.connection import PeerConnection
from p2ptrain.net.content import LocalContent
from p2ptrain.net.wire import RelayChunk, RelayHead, RelayRequest, encode_frame

__all__ = ["RelayHub", "RelayStatistics", "answer_relay"]

logger = logging.getLogger(__name__)

RELAY_CHUNK_BYTES = 256 << 10
_QUEUE_FRAMES = 64


@dataclass(frozen=True, slots=True)
class RelayStatistics:
    requests: int
    bytes_relayed: int
    failures: int
    in_flight: int


class RelayHub:
    """The seed side: matches answers to pending requests by id."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout = timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, asyncio.Queue[RelayHead | RelayChunk | None]]] = {}
        self._requests = self._bytes = self._failures = 0

    async def forward(
        self, connection: PeerConnection, method: str, path: str, range_header: str | None
    ) -> tuple[RelayHead, AsyncIterator[bytes]]:
        """Ask the private peer behind ``connection``; return its status line and a stream of
        its body. Raises TransportError when it does not answer in time."""
        request_id = next(self._ids)
        queue: asyncio.Queue[RelayHead | RelayChunk | None] = asyncio.Queue(_QUEUE_FRAMES)
        self._pending[request_id] = (connection.peer_id, queue)
        self._requests += 1
        try:
            connection.send(encode_frame(RelayRequest(request_id, method, path, range_header)))
            head = await self._next(queue, connection)
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        if not isinstance(head, RelayHead):
            self._pending.pop(request_id, None)
            self._failures += 1
            raise TransportError(f"relayed peer {connection.peer_id[:16]} sent no answer head")
        return head, self._body(request_id, queue, connection)

    async def _body(
        self,
        request_id: int,
        queue: asyncio.Queue[RelayHead | RelayChunk | None],
        connection: PeerConnection,
    ) -> AsyncIterator[bytes]:
        try:
            while True:
                frame = await self._next(queue, connection)
                if not isinstance(frame, RelayChunk):
                    raise TransportError("relayed answer ended early")
                self._bytes += len(frame.data)
                if frame.data:
                    yield frame.data
                if frame.last:
                    return
        finally:
            self._pending.pop(request_id, None)

    async def _next(
        self, queue: asyncio.Queue[RelayHead | RelayChunk | None], connection: PeerConnection
    ) -> RelayHead | RelayChunk:
        try:
            frame = await asyncio.wait_for(queue.get(), self._timeout)
        except TimeoutError:
            self._failures += 1
            raise TransportError(f"relayed peer {connection.peer_id[:16]} timed out") from None
        if frame is None:
            self._failures += 1
            raise TransportError(f"relayed peer {connection.peer_id[:16]} disconnected")
        return frame

    async def receive(self, connection: PeerConnection, frame: RelayHead | RelayChunk) -> None:
        """An answer frame from a private peer (back-pressure: waits while the reader lags)."""
        pending = self._pending.get(frame.request_id)
        if pending is None:
            return  # a late answer to a request given up on
        owner, queue = pending
        if owner != connection.peer_id:
            raise ProtocolViolation("relay answer for a request sent to another peer")
        try:
            await asyncio.wait_for(queue.put(frame), self._timeout)
        except TimeoutError:
            self._pending.pop(frame.request_id, None)

    def disconnected(self, peer_id: str) -> None:
        for owner, queue in list(self._pending.values()):
            if owner == peer_id:
                try:
                    queue.put_nowait(None)
                except asyncio.QueueFull:
                    _ = queue.get_nowait()
                    queue.put_nowait(None)

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(self._requests, self._bytes, self._failures, len(self._pending))


async def answer_relay(
    connection: PeerConnection, request: RelayRequest, content: LocalContent, timeout_s: float
) -> None:
    """The private side: answer a relayed request from our own content."""
    answer = content.answer(request.method, request.path, request.range)
    headers = dict(answer.headers)
    length = answer.length if answer.file is not None else len(answer.body)
    headers["Content-Length"] = str(length)
    connection.send(encode_frame(RelayHead(request.request_id, answer.status, headers)))
    if request.method == "HEAD":
        connection.send(encode_frame(RelayChunk(request.request_id, b"", last=True)))
        return
    if answer.file is None:
        connection.send(encode_frame(RelayChunk(request.request_id, answer.body, last=True)))
        return
    fd = os.open(answer.file, os.O_RDONLY)
    try:
        offset, end = answer.offset, answer.offset + answer.length
        while True:
            size = min(RELAY_CHUNK_BYTES, end - offset)
            data = await asyncio.to_thread(os.pread, fd, size, offset) if size else b""
            offset += len(data)
            last = offset >= end or not data
            frame = encode_frame(RelayChunk(request.request_id, data, last=last))
            await connection.send_wait(frame, timeout_s)
            if last:
                return
    finally:
        os.close(fd)
