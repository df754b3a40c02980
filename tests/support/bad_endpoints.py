"""Loopback endpoints that look like peers and are not: for liveness tests.

* :class:`Unanswering` accepts every TCP connection and never sends a byte (not even an
  HTTP status line): a peer behind a black hole, or a process that hangs;
* :class:`Trickling` accepts every connection and answers whatever it is asked with a
  valid-looking HTTP status line and headers that never end, dribbled out at 16 bytes per
  second: a peer on a dying link;
* :class:`Relay` forwards every connection to a real node, its answers held back by a
  delay, and -- with ``trickle_blobs`` -- dribbles out at 16 bytes per second whatever the
  node answers on a connection once it was asked for a blob (``GET /v1/blobs/...``): a
  peer whose link carries small answers (manifests, records, ``HEAD``) but chokes on a
  download.

Each runs one thread of its own (a selector over its sockets) from construction until
:meth:`close`, which closes every socket it holds; use them as context managers.
"""

from __future__ import annotations

import itertools
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

__all__ = ["Relay", "Trickling", "Unanswering"]

_TICK_S = 0.25


class _Listening:
    """A listener on 127.0.0.1 served by a thread of its own (:meth:`_serve`, started by the
    subclass once it is set up) until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        #: Where a peer record or ``--bootstrap`` points at it.
        self.address = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._release()
        self._listener.close()

    def _serve(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        """Close the sockets the thread served (it has ended)."""


class _Endpoint(_Listening):
    """A listener on 127.0.0.1 and the connections it accepted, served by one thread."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.bytes_received = 0
        self._connections: list[socket.socket] = []
        self._thread.start()

    def _release(self) -> None:
        for connection in self._connections:
            connection.close()
        self._connections.clear()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            next_tick = time.monotonic() + _TICK_S
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=max(0.0, next_tick - time.monotonic())):
                    if key.fileobj is self._listener:
                        self._accept(selector)
                    else:
                        assert isinstance(key.fileobj, socket.socket)
                        self._drain(selector, key.fileobj)
                if time.monotonic() >= next_tick:
                    next_tick += _TICK_S
                    for connection in list(self._connections):
                        self.tick(connection)

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            connection, _ = self._listener.accept()
        except BlockingIOError:
            return
        connection.setblocking(False)
        selector.register(connection, selectors.EVENT_READ)
        self._connections.append(connection)
        self.accepted += 1
        self.opened(connection)

    def _drain(self, selector: selectors.BaseSelector, connection: socket.socket) -> None:
        """Read (and ignore) what the client sends; forget it once it hangs up."""
        try:
            data = connection.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self.bytes_received += len(data)
        if not data:
            self._forget(selector, connection)

    def _forget(self, selector: selectors.BaseSelector, connection: socket.socket) -> None:
        selector.unregister(connection)
        self._connections.remove(connection)
        connection.close()

    def opened(self, connection: socket.socket) -> None:
        """A connection was accepted."""

    def tick(self, connection: socket.socket) -> None:
        """Every quarter of a second, for each open connection."""


class Unanswering(_Endpoint):
    """Accepts every connection and never answers. See the module docstring."""

    def __init__(self) -> None:
        super().__init__("unanswering-endpoint")


def _endless_answer() -> Iterator[int]:
    """An HTTP answer whose headers never end: a status line, then padding headers."""
    yield from b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\n"
    for index in itertools.count():
        yield from f"X-Padding-{index}: {'.' * 40}\r\n".encode()


class Trickling(_Endpoint):
    """Answers every connection at :attr:`BYTES_PER_S`, forever. See the module docstring."""

    BYTES_PER_S = 16

    def __init__(self) -> None:
        self._answers: dict[socket.socket, Iterator[int]] = {}
        self.bytes_sent = 0
        super().__init__("trickling-endpoint")

    def opened(self, connection: socket.socket) -> None:
        self._answers[connection] = _endless_answer()

    def tick(self, connection: socket.socket) -> None:
        answer = self._answers[connection]
        chunk = bytes(itertools.islice(answer, round(self.BYTES_PER_S * _TICK_S)))
        try:
            self.bytes_sent += connection.send(chunk)
        except (BlockingIOError, OSError):
            return  # a full buffer or a client gone: the next read notices


#: What a client sends to ask for a blob's bytes (``HEAD`` asks only for its size).
_BLOB_REQUEST = b"GET /v1/blobs/"


@dataclass(eq=False)
class _Leg:
    """One relayed connection: the client's socket, ours to the node, what each is owed."""

    client: socket.socket
    upstream: socket.socket | None
    to_upstream: bytearray = field(default_factory=bytearray)
    #: The node's answers and when each may go on to the client (``delay_s`` after it came).
    held: deque[tuple[float, bytes]] = field(default_factory=deque)
    to_client: bytearray = field(default_factory=bytearray)
    #: The client asked for a blob on this connection: what follows goes at 16 bytes/s.
    trickling: bool = False
    #: The end of what the client sent last, for a request line split across reads.
    tail: bytes = b""


class Relay(_Listening):
    """Forwards to ``upstream`` (a node's ``http://host:port``). See the module docstring.

    ``delay_s``: each piece of the node's answers reaches the client this long after it
    came (a longer path). ``trickle_blobs``: on a connection that asked for a blob, from
    then on the node's answers go out at :attr:`BYTES_PER_S` (only on the first
    ``trickled`` such connections, when given: a link that stalls, then recovers).
    :attr:`blob_requests` counts the trickled connections, :attr:`accepted` every one."""

    BYTES_PER_S = 16

    def __init__(
        self,
        upstream: str,
        *,
        delay_s: float = 0.0,
        trickle_blobs: bool = False,
        trickled: int | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream {upstream!r} is not http://host:port")
        self._upstream = (parts.hostname, parts.port)
        super().__init__("relay")
        self.delay_s = delay_s
        self.trickle_blobs = trickle_blobs
        self.trickled = trickled
        self.blob_requests = 0
        self._legs: dict[socket.socket, _Leg] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread.start()

    def _release(self) -> None:
        for leg in set(self._legs.values()):
            self._end(leg)
        self._selector.close()

    def _serve(self) -> None:
        next_tick = time.monotonic() + _TICK_S
        while not self._stop.is_set():
            wake = min([next_tick, *(leg.held[0][0] for leg in self._legs.values() if leg.held)])
            events = self._selector.select(timeout=max(0.0, wake - time.monotonic()))
            for key, mask in events:
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept()
                elif sock in self._legs:  # not ended by an earlier event of this round
                    self._ready(self._legs[sock], sock, mask)
            now = time.monotonic()
            trickle = now >= next_tick
            if trickle:
                next_tick += _TICK_S
            for leg in set(self._legs.values()):
                while leg.held and leg.held[0][0] <= now:
                    leg.to_client += leg.held.popleft()[1]
                self._flush(leg, trickle=trickle)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        self.accepted += 1
        try:
            upstream = socket.create_connection(self._upstream, timeout=5)
        except OSError:
            client.close()
            return
        for sock in (client, upstream):
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ)
        leg = _Leg(client, upstream)
        self._legs[client] = self._legs[upstream] = leg

    def _ready(self, leg: _Leg, sock: socket.socket, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if sock is leg.client:
                if not data:  # the client hung up: so do we
                    self._end(leg)
                    return
                seen = leg.tail + data
                more = self.trickled is None or self.blob_requests < self.trickled
                if self.trickle_blobs and more and not leg.trickling and _BLOB_REQUEST in seen:
                    leg.trickling = True
                    self.blob_requests += 1
                leg.tail = seen[-len(_BLOB_REQUEST) :]
                leg.to_upstream += data
            elif data:
                leg.held.append((time.monotonic() + self.delay_s, data))
            else:  # the node is done: the client gets what is owed, then the end
                self._selector.unregister(sock)
                del self._legs[sock]
                sock.close()
                leg.upstream = None
        self._flush(leg, trickle=False)

    def _flush(self, leg: _Leg, *, trickle: bool) -> None:
        """Send what is owed (a trickling client: a tick's worth, on ``trickle``)."""
        try:
            if leg.upstream is not None and leg.to_upstream:
                del leg.to_upstream[: leg.upstream.send(leg.to_upstream)]
            if leg.to_client and (trickle or not leg.trickling):
                limit = round(self.BYTES_PER_S * _TICK_S) if leg.trickling else len(leg.to_client)
                del leg.to_client[: leg.client.send(leg.to_client[:limit])]
        except BlockingIOError:
            pass
        except OSError:
            self._end(leg)
            return
        if leg.upstream is None and not leg.held and not leg.to_client:
            self._end(leg)
            return
        for sock, owed in ((leg.client, leg.to_client), (leg.upstream, leg.to_upstream)):
            if sock is not None:
                wants_write = bool(owed) and not (sock is leg.client and leg.trickling)
                events = selectors.EVENT_READ | (selectors.EVENT_WRITE if wants_write else 0)
                if self._selector.get_key(sock).events != events:
                    self._selector.modify(sock, events)

    def _end(self, leg: _Leg) -> None:
        for sock in (leg.client, leg.upstream):
            if sock is not None and sock in self._legs:
                self._selector.unregister(sock)
                del self._legs[sock]
                sock.close()
        leg.upstream = None
