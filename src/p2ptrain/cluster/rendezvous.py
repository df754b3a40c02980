"""Where members meet: the control endpoint every member serves, and the store its leader
hosts for each generation.

**The control endpoint** (asyncio streams) answers one request per connection, after the
handshake of :mod:`p2ptrain.cluster.proof`: the client proves the secret and its key over
both nonces and its request; a client whose proof fails is refused (``Refused``, saying that
the secrets differ) and never reaches the handler; the answer carries the server's proof
over its body, which :func:`ask` checks before believing a word of it. So the rendezvous of a
generation (the store's address, the generation, the ranks) goes only to members that proved
the secret, and comes only from one.

**The store** is a ``torch.distributed.TCPStore`` the leader opens for each generation on a
port the kernel picks (:func:`open_generation_store`), named in the generation's plan, and
drops when the generation ends. torch.distributed's store and collectives authenticate
nobody and encrypt nothing: a cluster belongs on a trusted LAN or a VPN (docs/clusters.md).

Faults, and what happens: a peer that does not connect, stalls or resets within the timeout
is a :class:`~p2ptrain.errors.TransportError` for the asker; one that sends bytes out of
protocol a :class:`~p2ptrain.errors.ProtocolViolation`; one whose proof of the secret fails
a :class:`SecretDiffers` (on both sides: the server reports the client it refused through
``on_refused``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

from p2ptrain.cluster.proof import NONCE_BYTES, SECRET_DIFFERS, Proof, check_proof, prove
from p2ptrain.cluster.proof import transcript as proof_transcript
from p2ptrain.cluster.wire import (
    Challenge,
    Frame,
    Hello,
    Refused,
    Reply,
    Request,
    Signed,
    decode_frame,
    decode_reply,
    decode_request,
    encode_body,
    frame_bytes,
    frame_length,
)
from p2ptrain.core.identity import PUBLIC_KEY_BYTES, Identity, peer_id_of
from p2ptrain.errors import ProtocolViolation, TransportError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

__all__ = [
    "ControlEndpoint",
    "EndpointStatistics",
    "SecretDiffers",
    "ask",
    "connect_generation_store",
    "open_generation_store",
]

log = logging.getLogger(__name__)

#: Seconds one frame may take to arrive (a handler's own wait comes on top).
FRAME_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64

Handler = Callable[[str, Request], Awaitable[Reply]]
F = TypeVar("F", Hello, Challenge, Signed)


class SecretDiffers(ProtocolViolation):
    """The peer and we hold different cluster secrets (or train different things)."""


@dataclass(frozen=True, slots=True)
class EndpointStatistics:
    answered: int  # requests answered after a good proof
    refused: int  # clients whose proof of the secret failed
    dropped: int  # connections closed on a fault (timeout, bad frame, too many at once)


@dataclass(frozen=True, slots=True)
class _Keys:
    cluster_id: str
    client_key: bytes
    server_key: bytes
    client_nonce: bytes
    server_nonce: bytes

    def transcript(self, direction: Literal["client", "server"], body: bytes) -> bytes:
        return proof_transcript(
            direction,
            cluster_id=self.cluster_id,
            client_key=self.client_key,
            server_key=self.server_key,
            client_nonce=self.client_nonce,
            server_nonce=self.server_nonce,
            body=body,
        )


async def _read_frame(reader: asyncio.StreamReader) -> Frame:
    async with asyncio.timeout(FRAME_TIMEOUT_S):
        length = frame_length(await reader.readexactly(4))
        return decode_frame(await reader.readexactly(length))


def _expect(frame: Frame, kind: type[F], peer: str) -> F:
    if isinstance(frame, Refused):
        raise SecretDiffers(frame.reason)
    if not isinstance(frame, kind):
        raise ProtocolViolation(f"{peer} sent a {type(frame).__name__}, not a {kind.__name__}")
    return frame


def _check_key(key: bytes, peer: str) -> None:
    if len(key) != PUBLIC_KEY_BYTES:
        raise ProtocolViolation(f"{peer} named a key of {len(key)} bytes")


class ControlEndpoint:
    """Serves proven members' requests with ``handler(peer_id, request)``."""

    def __init__(
        self,
        *,
        identity: Identity,
        secret: bytes,
        cluster_id: str,
        handler: Handler,
        on_refused: Callable[[str, str], None],
    ) -> None:
        self._identity, self._secret, self._cluster_id = identity, secret, cluster_id
        self._handler, self._on_refused = handler, on_refused
        self._server: asyncio.Server | None = None
        self._open = 0
        self._answered = self._refused = self._dropped = 0
        self.address = ""

    def statistics(self) -> EndpointStatistics:
        return EndpointStatistics(self._answered, self._refused, self._dropped)

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host:port`` (0: a free port); returns ``HOST:PORT``."""
        self._server = await asyncio.start_server(self._serve, host, port)
        bound = self._server.sockets[0].getsockname()[1]
        self.address = f"{host}:{bound}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = writer.get_extra_info("peername")
        peer = f"the member at {remote[0]}" if remote else "a member"
        self._open += 1
        try:
            if self._open > MAX_CONNECTIONS:
                raise TransportError("too many control connections at once")
            await self._exchange(reader, writer, peer)
        except (TransportError, ProtocolViolation, TimeoutError, OSError) as exc:
            self._dropped += 1
            log.debug("cluster control: dropped %s: %s", peer, exc)
        except asyncio.IncompleteReadError:
            self._dropped += 1
        finally:
            self._open -= 1
            writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), FRAME_TIMEOUT_S)

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> None:
        hello = _expect(await _read_frame(reader), Hello, peer)
        _check_key(hello.public_key, peer)
        if hello.cluster_id != self._cluster_id:
            writer.write(frame_bytes(Refused(reason="this member belongs to another cluster")))
            return
        keys = _Keys(
            self._cluster_id,
            hello.public_key,
            self._identity.public_key,
            hello.nonce,
            os.urandom(NONCE_BYTES),
        )
        writer.write(frame_bytes(Challenge(public_key=keys.server_key, nonce=keys.server_nonce)))
        await writer.drain()
        signed = _expect(await _read_frame(reader), Signed, peer)
        proof = Proof(signed.secret_mac, signed.signature)
        reason = check_proof(
            self._secret, keys.client_key, keys.transcript("client", signed.body), proof, peer=peer
        )
        if reason is not None:
            self._refused += 1
            told = SECRET_DIFFERS.format(peer=f"the member at {self.address}")
            writer.write(frame_bytes(Refused(reason=told)))
            await writer.drain()
            self._on_refused(peer, reason)
            return
        request = decode_request(signed.body)
        peer_id = peer_id_of(keys.client_key)
        if request.member.peer_id != peer_id:
            raise ProtocolViolation(f"{peer} speaks for another peer id than its key's")
        reply = await self._handler(peer_id, request)
        body = encode_body(reply)
        answer = prove(self._identity, self._secret, keys.transcript("server", body))
        writer.write(frame_bytes(Signed(body=body, secret_mac=answer.secret_mac,
                                        signature=answer.signature)))  # fmt: skip
        await writer.drain()
        self._answered += 1


async def ask(
    address: str,
    request: Request,
    *,
    identity: Identity,
    secret: bytes,
    cluster_id: str,
    timeout_s: float,
) -> tuple[str, Reply]:
    """Send ``request`` to the member at ``address`` (``HOST:PORT``); returns its proven
    peer id and its answer. Raises TransportError (unreachable, too slow), SecretDiffers or
    ProtocolViolation."""
    host, _, port = address.rpartition(":")
    peer = f"the member at {address}"
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            nonce = os.urandom(NONCE_BYTES)
            writer.write(frame_bytes(Hello(cluster_id=cluster_id, public_key=identity.public_key,
                                           nonce=nonce)))  # fmt: skip
            challenge = _expect(await _read_frame(reader), Challenge, peer)
            _check_key(challenge.public_key, peer)
            keys = _Keys(cluster_id, identity.public_key, challenge.public_key, nonce,
                         challenge.nonce)  # fmt: skip
            body = encode_body(request)
            mine = prove(identity, secret, keys.transcript("client", body))
            writer.write(frame_bytes(Signed(body=body, secret_mac=mine.secret_mac,
                                            signature=mine.signature)))  # fmt: skip
            await writer.drain()
            answer = _expect(await _read_frame(reader), Signed, peer)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
        raise TransportError(f"{peer} did not answer: {exc or type(exc).__name__}") from exc
    finally:
        if writer is not None:
            writer.close()
    proof = Proof(answer.secret_mac, answer.signature)
    reason = check_proof(
        secret, keys.server_key, keys.transcript("server", answer.body), proof, peer=peer
    )
    if reason is not None:
        raise SecretDiffers(reason)
    return peer_id_of(keys.server_key), decode_reply(answer.body)


def open_generation_store(host: str, timeout_s: float) -> TCPStore:
    """The leader's store for one generation, on ``host`` and a port the kernel picks
    (``store.port``)."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(
        host,
        0,
        None,
        True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def connect_generation_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """A member's connection to its leader's store (fails after ``timeout_s``)."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))
