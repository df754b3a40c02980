"""Loopback endpoints that look like peers and are not: for liveness tests.

* :class:`Unanswering` accepts every TCP connection and never sends a byte (not even an
  HTTP status line): a peer behind a black hole, or a process that hangs;
* :class:`Trickling` accepts every connection and answers whatever it is asked with a
  valid-looking HTTP status line and headers that never end, dribbled out at 16 bytes per
  second: a peer on a dying link.

Each runs one thread of its own (a selector over its sockets) from construction until
:meth:`close`, which closes every socket it holds; use them as context managers.
"""

from __future__ import annotations

import itertools
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Self

__all__ = ["Trickling", "Unanswering"]

_TICK_S = 0.25


class _Endpoint:
    """A listener on 127.0.0.1 and the connections it accepted, served by one thread."""

    def __init__(self, name: str) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        #: Where a peer record or ``--bootstrap`` points at it.
        self.address = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self.bytes_received = 0
        self._connections: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

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
        for connection in [*self._connections, self._listener]:
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
