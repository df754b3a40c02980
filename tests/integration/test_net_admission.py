"""Refusals at the door and on the socket: a node process turns away wrong secrets, missing
or foreign certificates, forged records, oversized and flooding sockets, and fuzzed frames
and bodies -- and keeps serving everyone else."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import pytest

from p2ptrain.core.envelope import Envelope, seal
from p2ptrain.core.records import PeerRecord
from p2ptrain.net.auth import ClientCredentials, nonce_from_challenge
from p2ptrain.net.client import PeerClient, Refused
from p2ptrain.net.wire import Gossip, Subscribe, encode_frame
from tests.support.net_child import admission_for, identity, network_from
from tests.support.net_children import NodeProcess, spawn_node, wait_until

pytestmark = pytest.mark.integration
__all__ = ["spawn_node"]

SECRET = bytes(range(32))
PRIVATE = {"secret": SECRET.hex()}
CERTIFIED = {"issuers": ["issuer"]}


def client_for(spec: dict[str, Any], label: str, **kw: Any) -> PeerClient:
    network = network_from(spec)
    secret = bytes.fromhex(spec["secret"]) if spec.get("secret") else None
    return PeerClient(ClientCredentials(network, identity(label), secret=secret, **kw))


async def honest_request(server: NodeProcess, spec: dict[str, Any]) -> int:
    client = client_for(spec, "honest", **_admission(spec, "honest"))
    try:
        records = await client.peer_records(server.address or "")
        return len(records)
    finally:
        await client.close()


def _admission(spec: dict[str, Any], label: str) -> dict[str, Any]:
    if not spec.get("issuers"):
        return {}
    return {"admission": admission_for(network_from(spec), identity(label), "issuer")}


async def refusal(client: PeerClient, address: str) -> tuple[Refused, float]:
    started = time.monotonic()
    with pytest.raises(Refused) as caught:
        await client.open_socket(address, max_frame_bytes=1 << 20, timeout_s=5)
    await client.close()
    return caught.value, time.monotonic() - started


def test_a_wrong_secret_is_refused_within_a_second(spawn_node: Callable[..., NodeProcess]) -> None:
    server = spawn_node(seed="server", network=PRIVATE, secret=SECRET.hex())
    intruder = client_for(PRIVATE, "intruder")
    intruder.credentials._secret = b"not the secret"  # knows the manifest, not the secret
    refused, seconds = asyncio.run(refusal(intruder, server.address or ""))
    assert refused.status == 403
    assert "wrong network secret" in refused.reason
    assert seconds < 1.0
    wait_until(lambda: "wrong network secret" in server.stderr(), 5, "the refusal in the log")
    assert asyncio.run(honest_request(server, PRIVATE)) == 1


def test_certificate_networks_refuse_missing_and_foreign_certificates(
    spawn_node: Callable[..., NodeProcess],
) -> None:
    server = spawn_node(seed="server", network=CERTIFIED, admission_issuer="issuer")
    network = network_from(CERTIFIED)

    without = client_for(CERTIFIED, "anon", **_admission(CERTIFIED, "anon"))
    without.credentials._admission = None
    refused, seconds = asyncio.run(refusal(without, server.address or ""))
    assert refused.status == 403 and seconds < 1.0
    assert "admission certificate" in refused.reason

    rogue = client_for(CERTIFIED, "rogue", admission=admission_for(network, identity("rogue"), "x"))
    refused, _ = asyncio.run(refusal(rogue, server.address or ""))
    assert "not an issuer" in refused.reason
    wait_until(lambda: "admission certificate" in server.stderr(), 5, "the refusal in the log")

    async def admitted() -> str:
        member = client_for(CERTIFIED, "member", **_admission(CERTIFIED, "member"))
        try:
            ws, peer = await member.open_socket(
                server.address or "", max_frame_bytes=1 << 20, timeout_s=5
            )
            await ws.close()
            return peer
        finally:
            await member.close()

    assert asyncio.run(admitted()) == server.peer_id


async def open_raw(client: PeerClient, address: str, max_frame: int = 8 << 20) -> Any:
    ws, _ = await client.open_socket(address, max_frame_bytes=max_frame, timeout_s=5)
    return ws


async def close_code_after(ws: Any, frames: list[bytes]) -> int | None:
    for frame in frames:
        if ws.closed:
            break
        try:
            await ws.send_bytes(frame)
        except (ConnectionError, aiohttp.ClientError):
            break
    async with asyncio.timeout(10):
        async for _ in ws:
            pass
    return ws.close_code  # type: ignore[no-any-return]


def test_forged_records_oversized_frames_and_floods_are_refused(
    spawn_node: Callable[..., NodeProcess],
) -> None:
    config = {"frames_per_s": 50.0, "frame_burst": 100, "flood_tolerance_s": 0.5}
    server = spawn_node(seed="server", config=config)
    network = network_from({})
    topic = f"net/{network.id}"

    async def attacks() -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        # A peer record signed by the wrong key.
        forger = client_for({}, "forger")
        ws = await open_raw(forger, server.address or "")
        victim = identity("victim")
        record = PeerRecord(
            network_id=network.id,
            public_key=victim.public_key,
            seq=1,
            roles=("seed",),
            reachability="public",
            addresses=("http://127.0.0.1:1",),
        )
        forged_frames = []
        for seq in range(1, 4):  # three different forgeries: three strikes, then banned
            genuine = seal(victim, msgspec.structs.replace(record, seq=seq)).envelope
            forged = Envelope(
                kind="peer", payload=genuine.payload, signer=genuine.signer, signature=bytes(64)
            )
            forged_frames.append(encode_frame(Gossip(topic, "peer", forged.encode())))
        codes["forged"] = await close_code_after(ws, forged_frames)
        await forger.close()
        # One frame over the limit.
        big = client_for({}, "big")
        ws = await open_raw(big, server.address or "")
        codes["oversized"] = await close_code_after(ws, [os.urandom((1 << 20) + 1)])
        await big.close()
        # A flood of well-formed frames.
        flooder = client_for({}, "flooder")
        ws = await open_raw(flooder, server.address or "")
        frame = encode_frame(Subscribe([topic]))
        codes["flood"] = await close_code_after(ws, [frame] * 5000)
        await flooder.close()
        return codes

    codes = asyncio.run(attacks())
    assert codes["forged"] == aiohttp.WSCloseCode.POLICY_VIOLATION, codes
    assert codes["oversized"] == aiohttp.WSCloseCode.MESSAGE_TOO_BIG, codes
    assert codes["flood"] == aiohttp.WSCloseCode.POLICY_VIOLATION, codes
    stats = server.ask(cmd="stats")
    assert "rejected=3" in stats["gossip"], stats
    log = server.stderr()
    assert "invalid signature" in log and "flooding" in log
    assert asyncio.run(honest_request(server, {})) >= 1


def test_fuzzed_frames_and_bodies_get_refusals_and_the_server_keeps_serving(
    spawn_node: Callable[..., NodeProcess],
) -> None:
    seed = random.randrange(2**32)
    print(f"fuzz seed {seed}")
    rng = random.Random(seed)
    server = spawn_node(seed="server")
    address = server.address or ""
    statuses: list[int] = []
    codes: list[int | None] = []

    async def fuzz() -> None:
        for i in range(20):
            attacker = client_for({}, f"fuzzer-{i}")
            ws = await open_raw(attacker, address)
            # Random bytes, then a byte msgpack never uses, in case the random ones decoded.
            frames = [rng.randbytes(rng.randrange(0, 300)), b"\xc1"]
            codes.append(await close_code_after(ws, frames))
            await attacker.close()
        # Raw HTTP from another loopback address: junk credentials, bodies and paths.
        connector = aiohttp.TCPConnector(local_addr=("127.0.0.3", 0))
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.get(f"{address}/v1/peers") as r:
                nonce = nonce_from_challenge(r.headers.get("WWW-Authenticate"))
            assert nonce
            for i in range(40):
                junk = rng.randbytes(rng.randrange(1, 200))
                headers = {"Authorization": "P2PTrain " + junk.hex()[: rng.randrange(1, 300)]}
                if i % 3 == 0:
                    creds = ClientCredentials(network_from({}), identity("fuzzer"), secret=None)
                    headers["Authorization"], _ = creds.header(nonce, "POST", "/v1/blobs")
                    headers["P2PTrain-Blob-Id"] = rng.choice(["zz", "0" * 64, junk.hex()[:64]])
                path = rng.choice(
                    ["/v1/blobs", "/v1/peers", "/ws", "/v1/heads/x", "/v1/" + junk.hex()]
                )
                method = rng.choice(["GET", "POST", "HEAD"])
                async with session.request(method, address + path, data=junk, headers=headers) as r:
                    statuses.append(r.status)

    asyncio.run(fuzz())
    assert codes == [aiohttp.WSCloseCode.POLICY_VIOLATION] * 20, (seed, codes)
    assert statuses and all(400 <= s < 500 for s in statuses), (seed, statuses)
    assert asyncio.run(honest_request(server, {})) >= 1
