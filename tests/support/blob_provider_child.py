"""A blob provider in a child process: a NetNode serving one blob from its own store.

argv[1] is a JSON object: ``data_dir``, ``seed`` (identity seed label), optional ``blob``
(a file to put in the store), ``corrupt_every`` (after storing the blob, flip one byte in
every that many bytes of the stored file: the server sends files without re-hashing them,
so this provider serves bad bytes), ``relay`` (a seed's address: run no server and be
reachable through that seed's relay instead).

The child prints ``{"event": "up", "address": ..., "peer_id": ..., "blob": id or null}``
once it can be reached (a relayed child first checks that its blob is reachable through
the seed), and exits when stdin closes. Every process builds the same network manifest
from the same authority label, so the network id is the same everywhere.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.errors import TransportError
from p2ptrain.net.config import NetConfig
from p2ptrain.net.node import NetNode
from p2ptrain.store.blobs import BlobStore
from tests.support.child_io import emit, wait_for_stdin_eof


def identity(label: str) -> Identity:
    return Identity.from_seed(hashlib.sha256(f"blob-provider/{label}".encode()).digest())


def network() -> NetworkManifest:
    return NetworkManifest(name="transfer-test", authority=identity("authority").public_key)


def corrupt(path: Path, every: int) -> None:
    """Flip one byte in every ``every`` bytes of ``path``, in place."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as file:
        size = file.seek(0, os.SEEK_END)
        for offset in range(every // 2, size, every):
            file.seek(offset)
            (byte,) = file.read(1)
            file.seek(offset)
            file.write(bytes([byte ^ 0xFF]))


async def wait_until_reachable(node: NetNode, address: str, blob: str) -> None:
    """Wait (20 s at most) until a HEAD for our blob through the relay finds it."""
    async with asyncio.timeout(20):
        while True:
            try:
                if await node.client.has_blob(address, blob) is not None:
                    return
            except TransportError:
                pass  # the seed does not know us yet
            await asyncio.sleep(0.02)  # the condition is re-checked; this only paces it


async def main(spec: dict[str, Any]) -> None:
    with BlobStore(spec["data_dir"]) as store:
        blob = None
        if spec.get("blob"):
            with open(spec["blob"], "rb") as source:
                blob = store.put_stream(source)
            if spec.get("corrupt_every"):
                corrupt(store.path(blob), int(spec["corrupt_every"]))
        relay = spec.get("relay")
        node = NetNode(
            identity=identity(spec["seed"]),
            network=network(),
            blobs=store,
            config=NetConfig(host=None if relay else "127.0.0.1", discovery_interval_s=0.1),
            relay=relay,
        )
        async with node:
            address = node.address
            if relay:
                if blob is None:
                    raise SystemExit("a relayed provider needs a blob to check its relay with")
                address = f"{relay}/v1/relay/{node.peer_id}"
                await wait_until_reachable(node, address, blob)
            emit("up", address=address, peer_id=node.peer_id, blob=blob)
            await wait_for_stdin_eof()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
