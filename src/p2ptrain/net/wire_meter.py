"""Bytes a node's TCP connections carried, counted by the kernel.

A node's traffic goes many ways: aiohttp requests and responses (blobs served with
``sendfile``), gossip websockets, the range reader's raw connections, relays, TLS. Counting
each in Python would miss some and count others twice; the kernel already counts every TCP
connection (``TCP_INFO``: ``tcpi_bytes_received``, and ``tcpi_bytes_acked`` plus what still
waits in the send queue for what the node wrote). :class:`WireMeter` reads those counters
for every connection of an event loop made by :func:`metered_loop`: live connections when
asked, a closing one as it closes (its socket is still open then). The figures are TCP
payload bytes -- HTTP and TLS framing included, IP and TCP headers not.

The event loop is a :class:`asyncio.SelectorEventLoop` whose socket transports report to the
meter as they open and close (``_make_socket_transport`` is the one place the loop builds
every accepted and dialed TCP transport). Where that is not available (not Linux, or an
asyncio without that hook) the loop is a plain one and :func:`loop_meter` gives None: a
status then shows no measured figure rather than a wrong one.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import sys
import termios
from asyncio import selector_events
from typing import Any

__all__ = ["WireMeter", "loop_meter", "metered_loop"]

#: Offsets of ``tcpi_bytes_acked`` and ``tcpi_bytes_received`` in Linux's ``struct tcp_info``
#: (since 4.1; both u64).
_ACKED_AT = 120
_RECEIVED_AT = 128
_INFO_BYTES = _RECEIVED_AT + 8


def _counters(sock: socket.socket) -> tuple[int, int] | None:
    """(bytes written, bytes received) of a TCP socket, or None if the kernel will not say."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < _INFO_BYTES:
            return None
        (acked,) = struct.unpack_from("=Q", info, _ACKED_AT)
        (received,) = struct.unpack_from("=Q", info, _RECEIVED_AT)
        queued = bytearray(4)
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, queued)  # not yet acknowledged
        return acked + struct.unpack("=i", queued)[0], received
    except (OSError, ValueError):
        return None


class WireMeter:
    """Bytes written to and received from TCP connections so far, all connections of one
    event loop together."""

    def __init__(self) -> None:
        self._open: dict[int, socket.socket] = {}
        self._closed_sent = 0
        self._closed_received = 0

    def opened(self, sock: socket.socket) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            self._open[id(sock)] = sock

    def closing(self, sock: socket.socket) -> None:
        """The connection is about to close: keep what it carried."""
        if self._open.pop(id(sock), None) is None:
            return
        counted = _counters(sock)
        if counted is not None:
            self._closed_sent += counted[0]
            self._closed_received += counted[1]

    @property
    def connections(self) -> int:
        return len(self._open)

    def totals(self) -> tuple[int, int]:
        """(sent, received) bytes of every connection so far, open ones included."""
        sent, received = self._closed_sent, self._closed_received
        for sock in list(self._open.values()):
            counted = _counters(sock)
            if counted is not None:
                sent += counted[0]
                received += counted[1]
        return sent, received


#: asyncio's TCP transport of the selector loop (private, so untyped; checked by _supported).
_SocketTransport: Any = getattr(selector_events, "_SelectorSocketTransport", object)


class _MeteredTransport(_SocketTransport):  # type: ignore[misc]
    """A socket transport that tells its loop's meter when its connection closes."""

    def _call_connection_lost(self, exc: BaseException | None) -> None:
        meter = loop_meter(self._loop)
        if meter is not None and self._sock is not None:
            meter.closing(self._sock)
        super()._call_connection_lost(exc)


class _MeteredLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self.wire_meter = WireMeter()

    def _make_socket_transport(
        self,
        sock: socket.socket,
        protocol: asyncio.BaseProtocol,
        waiter: asyncio.Future[Any] | None = None,
        *,
        extra: dict[str, Any] | None = None,
        server: asyncio.Server | None = None,
    ) -> asyncio.Transport:
        self.wire_meter.opened(sock)
        transport: asyncio.Transport = _MeteredTransport(
            self, sock, protocol, waiter, extra, server
        )
        return transport


def _supported() -> bool:
    return (
        sys.platform.startswith("linux")
        and hasattr(socket, "TCP_INFO")
        and hasattr(_SocketTransport, "_call_connection_lost")
        and hasattr(asyncio.SelectorEventLoop, "_make_socket_transport")
    )


def metered_loop() -> asyncio.AbstractEventLoop:
    """A new event loop whose TCP connections a :class:`WireMeter` counts (a plain one
    where the platform cannot count them). Pass it as ``asyncio.run(..., loop_factory=...)``
    or ``asyncio.Runner(loop_factory=...)``."""
    if _supported():
        return _MeteredLoop()
    return asyncio.new_event_loop()


def loop_meter(loop: asyncio.AbstractEventLoop | None = None) -> WireMeter | None:
    """The meter of ``loop`` (default: the running loop), or None if it has none."""
    if loop is None:
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
    meter = getattr(loop, "wire_meter", None)
    return meter if isinstance(meter, WireMeter) else None
