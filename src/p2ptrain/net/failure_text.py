"""A failed connection or request in a few plain words, for the messages people read.

aiohttp's exceptions print as their repr: ``ClientConnectorError(ConnectionKey(host=...,
port=9, is_ssl=False, ssl=True, proxy=None, ...), ConnectionRefusedError(111, ...))`` fills a
line and says little. :func:`transport_reason` keeps what matters, what failed and where:
``connection refused: nothing listens on 127.0.0.1:9``. The caller puts it after what it was
doing and before what to do about it.
"""

from __future__ import annotations

import aiohttp

__all__ = ["transport_reason"]


#: Failures said the same way wherever they happen, most specific first.
_FIXED: tuple[tuple[type[BaseException], str], ...] = (
    (aiohttp.ConnectionTimeoutError, "no connection within the time limit"),
    (aiohttp.SocketTimeoutError, "no answer within the time limit"),
    (TimeoutError, "timed out"),
    (aiohttp.ServerDisconnectedError, "the peer closed the connection before it answered"),
    (aiohttp.ClientPayloadError, "the answer broke off before its end"),
    (ConnectionResetError, "the peer reset the connection"),
    (ConnectionRefusedError, "connection refused: nothing listens there"),
)


def transport_reason(exc: BaseException) -> str:
    """Why a connection or a request failed, without the exception's repr."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return _connect_reason(exc)
    for kind, text in _FIXED:
        if isinstance(exc, kind):
            return text
    if isinstance(exc, aiohttp.InvalidURL):
        return f"{exc.url} is not a valid http address"
    if isinstance(exc, OSError) and exc.strerror:
        return _sentence(exc.strerror)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _connect_reason(exc: aiohttp.ClientConnectorError) -> str:
    where = f"{exc.host}:{exc.port}"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"the name {exc.host} does not resolve"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"the TLS certificate of {where} is refused ({exc.certificate_error})"
    if isinstance(exc, aiohttp.ClientSSLError):
        return f"the TLS handshake with {where} failed ({exc.os_error})"
    if isinstance(exc.os_error, ConnectionRefusedError):
        return f"connection refused: nothing listens on {where}"
    if isinstance(exc.os_error, TimeoutError):
        return f"no connection to {where} within the time limit"
    reason = exc.os_error.strerror or str(exc.os_error) or type(exc.os_error).__name__
    return f"cannot connect to {where}: {_sentence(reason)}"


def _sentence(text: str) -> str:
    """An OS message as part of ours: ``No route to host`` -> ``no route to host``."""
    return text[:1].lower() + text[1:] if text[1:2].islower() else text
