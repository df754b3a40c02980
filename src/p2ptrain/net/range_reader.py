"""Ranges of a blob over plain HTTP/1.1, with little work per byte beyond the kernel's.

A :class:`RangeReader` sends ``GET /v1/blobs/{id}`` with ``Range`` on a kept-alive
connection of its own (an :class:`asyncio.BufferedProtocol`) and asks for the next range
before the current one is in (pipelined: the provider goes on sending with no round trip
between ranges). The kernel receives into one reused buffer of a few MiB, which is
``pwrite``-n where its bytes belong in the file: per byte, a copy out of the socket and a
copy into the page cache; per few MiB, one trip through the event loop. A general client
(aiohttp) makes new ``bytes`` for every piece of at most 256 KiB and passes each through
its parser and stream: on loopback, where the CPU is the limit, that overhead decides.

Receiving straight into a writable shared mapping of the file (one copy) measured slower
and less steady: a page the kernel maps in for writing is first filled (zeroed, for a
preallocated extent), an extra pass over every byte, and writing back pages that are mapped
writable costs a TLB flush on every CPU for each page.

The head of an answer is parsed and judged by the pure :mod:`p2ptrain.net.range_answer`:
the answer must be the range asked for, exactly, before a byte of its body touches the
file; its errors are the fetcher's.

Only ``http://`` addresses; TLS (certificate pinning) stays with :class:`PeerClient`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from p2ptrain.errors import LocalError, ProtocolViolation, StorageFault, TransportError
from p2ptrain.net.client import PeerClient, Refused
from p2ptrain.net.failure_text import transport_reason
from p2ptrain.net.partial_file import pwrite_all
from p2ptrain.net.range_answer import (
    MAX_HEAD_BYTES,
    BadAnswer,
    RangeRequest,
    ResponseHead,
    UnsupportedAnswer,
    body_length,
    fits_a_request_line,
    parse_head,
)

__all__ = ["RangeReader", "RangeReaderStatistics"]

#: Body bytes are received into a buffer of this size and pwritten from it. Larger means
#: fewer trips through the event loop (the kernel hands over what the socket holds, often
#: a few MiB), which costs more than the cache a smaller buffer would stay in.
_BOUNCE_BYTES = 4 << 20
#: The reader's task is woken (to count bytes, advance the hasher) every this many bytes.
_PROGRESS_BYTES = 1 << 20
#: The next range is asked for once this much of the current one is left to come: the
#: provider then starts on it as soon as it has sent the current one, with no round trip.
_AHEAD_BYTES = 8 << 20

# -- the shell: one connection ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RangeReaderStatistics:
    connections: int  # connections opened
    requests: int  # requests sent
    bytes: int  # body bytes received


class _Exchange:
    """One request sent on a connection, and what has come back for it so far."""

    __slots__ = (
        "accepted",
        "error",
        "fd",
        "head",
        "position",
        "received",
        "request",
        "waiter",
        "wake_at",
    )

    def __init__(self, request: RangeRequest, fd: int) -> None:
        self.request = request
        self.fd = fd  # where the body goes: byte i of the blob to offset i
        self.head: ResponseHead | None = None
        #: Whether the head fits the request: the body lands in the file.
        self.accepted = False
        #: Why the exchange failed (the connection is then done with).
        self.error: TransportError | LocalError | None = None
        self.received = 0  # bytes of the answer so far, head included
        self.position = request.start  # the next body byte lands here
        self.waiter: asyncio.Future[None] | None = None
        self.wake_at = request.start  # wake the waiter once the body reaches this byte

    @property
    def over(self) -> bool:
        return self.error is not None or self.position == self.request.end

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, error: TransportError | LocalError) -> None:
        if self.error is None and self.position < self.request.end:
            self.error = error
        self.wake()


class _RangeProtocol(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection carrying range requests, answered in order (requests may be
    sent before the answer to the previous one is in: pipelined). Each answer's head is
    judged by :func:`body_length` as soon as it is in; only an answer that fits lets its
    body land in the file. The reader's task waiting on an exchange is woken every
    ``_PROGRESS_BYTES``, at the end of the body, and on an error."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._pending: deque[_Exchange] = deque()  # sent and not fully answered, in order
        self._head = bytearray(MAX_HEAD_BYTES)
        self._filled = 0  # bytes of the next answer's head in _head
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.requests = 0
        #: Set when the connection can carry no more requests.
        self.broken = False

    @property
    def usable(self) -> bool:
        return self._transport is not None and not self.broken

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def send(self, request: RangeRequest, fd: int, authorization: Mapping[str, str]) -> _Exchange:
        assert self._transport is not None and not self.broken
        exchange = _Exchange(request, fd)
        self._pending.append(exchange)
        self.requests += 1
        self._transport.write(request.encode(authorization))
        return exchange

    def abort(self) -> None:
        """Drop the connection; every exchange not over fails."""
        self._fail_all(None, "was cut off by this side")

    def close(self) -> None:
        self.broken = True
        if self._transport is not None:
            self._transport.close()

    # -- the transport's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        exchange = self._pending[0] if self._pending else None
        if exchange is not None and exchange.accepted:
            return _bounce()[: exchange.request.end - exchange.position]
        return memoryview(self._head)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if not self._pending:
            self._fail_all(BadAnswer(f"{self._who()} sent {nbytes} bytes nobody asked for"))
            return
        exchange = self._pending[0]
        exchange.received += nbytes
        if not exchange.accepted:
            self._filled += nbytes
            self._head_updated(self._filled - nbytes)
        elif self._land(exchange, _bounce()[:nbytes]):
            if exchange.position == exchange.request.end:
                self._answered()
            elif exchange.position >= exchange.wake_at:
                exchange.wake()

    def eof_received(self) -> bool:
        self._fail_all(None, "ended the answer")
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(None, "broke off" if exc is None else f"broke off ({transport_reason(exc)})")
        self._transport = None
        if not self.closed.done():
            self.closed.set_result(None)

    # -- inside

    def _head_updated(self, searched: int) -> None:
        """Bytes arrived for the head of the first pending answer: judge it once it is
        complete; the bytes after it are its body (and, for a short body, maybe the next
        answer's head)."""
        while self._pending:
            exchange = self._pending[0]
            ends = self._head.find(b"\r\n\r\n", max(0, searched - 3), self._filled)
            if ends < 0:
                if self._filled == len(self._head):
                    self._fail_all(
                        BadAnswer(f"{self._who()} sent a head over {MAX_HEAD_BYTES} bytes")
                    )
                return
            ends += 4
            try:
                exchange.head = parse_head(bytes(self._head[:ends]))
                body_length(exchange.head, exchange.request)
            except ProtocolViolation as exc:
                self._fail_all(BadAnswer(f"{self._who()} sent a malformed answer: {exc}"))
                return
            except TransportError as exc:
                self._fail_all(exc)
                return
            exchange.accepted = True
            request = exchange.request
            early = memoryview(self._head)[ends : self._filled]
            body = early[: request.end - exchange.position]
            rest = bytes(early[len(body) :])
            self._filled = 0
            if not self._land(exchange, body):
                return
            if exchange.position < request.end:
                exchange.wake()
                return
            if not self._answered():
                return
            if rest:
                if not self._pending:
                    self._fail_all(BadAnswer(f"{self._who()} sent more than the bytes asked"))
                    return
                self._head[: len(rest)] = rest
                self._filled, searched = len(rest), 0
                self._pending[0].received += len(rest)

    def _land(self, exchange: _Exchange, data: memoryview) -> bool:
        """Write body bytes at the exchange's position; False (and the connection dropped)
        when the disk refused them."""
        if not data:
            return True
        try:
            pwrite_all(exchange.fd, data, exchange.position)
        except OSError as exc:
            blob = exchange.request.blob_id
            exchange.fail(StorageFault(f"blob {blob}", exc.strerror or str(exc)))
            self._fail_all(None, "was cut off by this side")
            return False
        exchange.position += len(data)
        return True

    def _answered(self) -> bool:
        """The first pending exchange has its whole body. False when the connection ends
        with it (the server said so)."""
        exchange = self._pending.popleft()
        exchange.wake()
        assert exchange.head is not None
        if not exchange.head.keep_alive:
            self.close()
            self._fail_all(None, "closed the connection")
            return False
        return True

    def _fail_all(self, error: TransportError | None, how: str = "") -> None:
        """The connection is done with: the exchange being answered fails with ``error``
        (else: the provider ``how``), those after it as not answered."""
        self.broken = True
        for index, exchange in enumerate(self._pending):
            if index == 0 and error is not None:
                exchange.fail(error)
            elif index == 0 and exchange.received:
                exchange.fail(self._broken(exchange, how))
            else:
                exchange.fail(self._broken(exchange, "closed the connection before answering"))
        self._pending.clear()
        if self._transport is not None:
            self._transport.abort()

    def _who(self) -> str:
        return self._pending[0].request.provider if self._pending else "the provider"

    @staticmethod
    def _broken(exchange: _Exchange, what: str) -> TransportError:
        request = exchange.request
        return TransportError(
            f"{request.provider} {what} (at byte {exchange.position} of "
            f"{request.start}-{request.end})"
        )


class RangeReader:
    """Range GETs from one provider (an ``http://`` address) over one kept-alive connection,
    opened on first use and again after an error; each :meth:`read` lands its bytes in a
    file (see the module docstring). :meth:`send_ahead` asks for the next range before the
    current one is in, so that the provider sends it without a pause. ``timeout_s`` bounds
    each wait: to connect, for the answer's head, for the next bytes of its body."""

    def __init__(self, client: PeerClient, address: str, *, timeout_s: float) -> None:
        parts = urlsplit(address)
        if parts.scheme != "http":
            raise LocalError(f"a RangeReader speaks plain http, not {address!r:.80}")
        self.address = address
        self._client = client
        self._timeout_s = timeout_s
        self._protocol: _RangeProtocol | None = None
        self._ahead: dict[RangeRequest, _Exchange] = {}
        self._connections = self._requests = self._bytes = 0
        #: False once the provider sent an answer this reader cannot read.
        self.usable = True

    def statistics(self) -> RangeReaderStatistics:
        return RangeReaderStatistics(self._connections, self._requests, self._bytes)

    async def __aenter__(self) -> RangeReader:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def send_ahead(self, request: RangeRequest, fd: int) -> bool:
        """Send ``request`` now, on the connection still busy with the current one; read it
        next with :meth:`read`. False when it cannot go now (read sends it then)."""
        protocol = self._protocol
        if protocol is None or not protocol.usable or not fits_a_request_line(request):
            return False
        authorization, _ = self._client.authorization(request.provider, "GET", request.path)
        if not authorization or request in self._ahead:
            return False
        self._ahead[request] = protocol.send(request, fd, authorization)
        self._requests += 1
        return True

    async def read(
        self,
        request: RangeRequest,
        fd: int,
        landed: Callable[[int], None],
        ask_ahead: Callable[[], RangeRequest | None] | None = None,
    ) -> None:
        """GET ``request``'s range and write it at its offsets in ``fd``, calling
        ``landed(count)`` as bytes land (and, after a failure, for the bytes that did).
        Once the rest of the body is no more than ``_AHEAD_BYTES``, ``ask_ahead()`` is
        called once for the request to read next, which is sent at once (see
        :meth:`send_ahead`). Raises TransportError (MissingBlob, BadAnswer, Refused,
        UnsupportedAnswer among them), or LocalError when the file cannot be written."""
        if not fits_a_request_line(request):
            raise BadAnswer(f"{request.provider!r:.80} cannot be asked with a plain request")
        exchange = self._ahead.pop(request, None)
        reused = exchange is not None  # sent behind another request
        challenged = False
        for _ in range(3):  # once more for a connection closed as we asked, once for a nonce
            if exchange is None:
                protocol, reused = await self._connection()
                exchange = protocol.send(request, fd, await self._authorization(request))
                self._requests += 1
            try:
                while exchange.head is None and exchange.error is None:
                    await self._wait(exchange)
            except BaseException:
                self._drop()
                raise
            if exchange.accepted:
                await self._receive_body(exchange, landed, ask_ahead)
                return
            error, head, answered = exchange.error, exchange.head, exchange.received > 0
            assert error is not None
            exchange = None
            if not answered and reused and not isinstance(error, BadAnswer | LocalError):
                continue  # not answered: the connection closed as we asked; ask again
            if isinstance(error, Refused) and error.status == 401 and not challenged:
                assert head is not None
                if self._client.learn_nonce(request.provider, head.headers.get("www-authenticate")):
                    challenged = True
                    continue
            if isinstance(error, UnsupportedAnswer):
                self.usable = False
            raise error
        raise TransportError(f"{request.provider} closed every connection before answering")

    async def _receive_body(
        self,
        exchange: _Exchange,
        landed: Callable[[int], None],
        ask_ahead: Callable[[], RangeRequest | None] | None,
    ) -> None:
        request = exchange.request
        reported = request.start
        try:
            while True:
                position = exchange.position
                if position > reported:
                    self._bytes += position - reported
                    landed(position - reported)
                    reported = position
                if exchange.error is not None:
                    raise exchange.error
                if ask_ahead is not None and request.end - position <= _AHEAD_BYTES:
                    following = ask_ahead()
                    ask_ahead = None
                    if following is not None:
                        self.send_ahead(following, exchange.fd)
                if position == request.end:
                    return
                await self._wait(exchange)
        except BaseException:
            if not exchange.over:
                self._drop()
            raise

    async def _wait(self, exchange: _Exchange) -> None:
        """Wait for the exchange's next event; raise TransportError when no byte of it
        arrived for timeout_s."""
        before = exchange.received
        exchange.wake_at = exchange.position + _PROGRESS_BYTES
        exchange.waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(self._timeout_s):
                await exchange.waiter
        except TimeoutError:
            if exchange.received != before:
                return  # bytes trickle in, under the wake-up step: not a stall
            request = exchange.request
            error = TransportError(
                f"{request.provider} sent nothing for {self._timeout_s:g}s (at byte "
                f"{exchange.position} of {request.start}-{request.end})"
            )
            exchange.fail(error)
            self._drop()
            raise error from None
        finally:
            exchange.waiter = None

    async def _authorization(self, request: RangeRequest) -> Mapping[str, str]:
        provider, path = request.provider, request.path
        authorization, _ = self._client.authorization(provider, "GET", path)
        if not authorization:
            try:
                async with asyncio.timeout(self._timeout_s):
                    await self._client.ensure_nonce(provider)
            except TimeoutError:
                raise TransportError(
                    f"{provider} sent no nonce within {self._timeout_s:g}s"
                ) from None
            authorization, _ = self._client.authorization(provider, "GET", path)
        return authorization

    async def _connection(self) -> tuple[_RangeProtocol, bool]:
        """The kept-alive connection, or a new one; and whether it carried requests before.
        A connection with answers in flight that nobody will read is dropped."""
        protocol = self._protocol
        if protocol is not None and protocol.usable and not protocol.busy:
            return protocol, protocol.requests > 0
        self._drop()
        parts = urlsplit(self.address)
        try:
            host, port = parts.hostname, parts.port or 80
        except ValueError as exc:
            raise TransportError(f"bad address {self.address!r:.80}: {exc}") from None
        if not host:
            raise TransportError(f"no host in the address {self.address!r:.80}")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                _, protocol = await loop.create_connection(_RangeProtocol, host, port)
        except TimeoutError:
            raise TransportError(
                f"cannot connect to {self.address} within {self._timeout_s:g}s"
            ) from None
        except OSError as exc:
            raise TransportError(
                f"cannot connect to {self.address}: {transport_reason(exc)}"
            ) from exc
        self._connections += 1
        self._protocol = protocol
        return protocol, False

    def _drop(self) -> None:
        """Abort the connection (an answer is in flight that nobody will read)."""
        protocol, self._protocol = self._protocol, None
        self._ahead.clear()
        if protocol is not None:
            protocol.abort()

    async def close(self) -> None:
        """Close the connection and wait (timeout_s at most) until it is closed."""
        protocol = self._protocol
        if protocol is None:
            return
        if protocol.busy:
            self._drop()
        else:
            self._protocol = None
            protocol.close()
        try:
            async with asyncio.timeout(self._timeout_s):
                await asyncio.shield(protocol.closed)
        except TimeoutError:
            protocol.abort()


_THREAD = threading.local()


def _bounce() -> memoryview:
    """This thread's receive buffer. The connections of an event loop share it: a selector
    event loop (p2ptrain runs on Unix) calls ``get_buffer``, ``recv_into`` and then
    ``buffer_updated``, which writes the bytes out, with nothing in between."""
    try:
        buffer: memoryview = _THREAD.bounce
    except AttributeError:
        buffer = _THREAD.bounce = memoryview(bytearray(_BOUNCE_BYTES))
    return buffer
