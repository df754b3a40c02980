"""Failed connections and requests in plain words: what failed and where, never aiohttp's
repr."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from p2ptrain.errors import TransportError
from p2ptrain.net.client import fetch_network_manifest
from p2ptrain.net.failure_text import transport_reason


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port  # closed again: nothing listens there


async def _connect_error(url: str) -> BaseException:
    async with aiohttp.ClientSession() as session:
        try:
            async with session.get(url):
                pass
        except aiohttp.ClientError as exc:
            return exc
    raise AssertionError(f"{url} answered")


def test_a_refused_connection_names_the_address() -> None:
    port = _closed_port()
    error = asyncio.run(_connect_error(f"http://127.0.0.1:{port}/"))
    assert isinstance(error, aiohttp.ClientConnectorError)
    assert transport_reason(error) == f"connection refused: nothing listens on 127.0.0.1:{port}"


def test_fetching_a_manifest_from_nowhere_says_so_in_one_plain_line() -> None:
    where = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(TransportError) as info:
        asyncio.run(fetch_network_manifest(f"http://{where}", timeout_s=10))
    reason = f"connection refused: nothing listens on {where}"
    assert str(info.value) == f"cannot reach http://{where}: {reason}"


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (aiohttp.ConnectionTimeoutError(), "no connection within the time limit"),
        (aiohttp.SocketTimeoutError(), "no answer within the time limit"),
        (TimeoutError(), "timed out"),
        (aiohttp.ServerDisconnectedError(), "the peer closed the connection before it answered"),
        (aiohttp.ClientPayloadError("Response payload is not completed"), "the answer broke off"),
        (ConnectionResetError(104, "Connection reset by peer"), "the peer reset the connection"),
        (ConnectionRefusedError(111, "Connect call failed"), "connection refused"),
        (aiohttp.InvalidURL("http//x"), "http//x is not a valid http address"),
        (OSError(113, "No route to host"), "no route to host"),
        (OSError(5, "I/O error"), "I/O error"),
        (ValueError("odd"), "ValueError: odd"),
        (RuntimeError(), "RuntimeError"),
    ],
)
def test_each_failure_in_words(error: BaseException, reason: str) -> None:
    assert transport_reason(error).startswith(reason)
