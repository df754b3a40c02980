"""The node's HTTP routes over real sockets: blob ranges, pushed blobs checked before they
are stored, and metrics for loopback callers."""

from __future__ import annotations

import asyncio
import hashlib
import random
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.errors import TransportError
from p2ptrain.net.client import BLOB_ID_HEADER
from p2ptrain.net.config import NetConfig
from p2ptrain.net.node import NetNode
from p2ptrain.store.blobs import BlobStore
from tests.support.builders import identity

pytestmark = pytest.mark.integration

NETWORK = NetworkManifest(name="http", authority=identity(99).public_key)


def node(tmp_path: Path, n: int, **config: object) -> NetNode:
    return NetNode(
        identity=identity(n),
        network=NETWORK,
        blobs=BlobStore(tmp_path / str(n)),
        config=NetConfig(**config),  # type: ignore[arg-type]
    )


def test_ranges_uploads_and_metrics(tmp_path: Path) -> None:
    data = random.Random(3).randbytes(1 << 20)

    async def scenario() -> dict[str, object]:
        seen: dict[str, object] = {}
        async with node(tmp_path, 1, max_upload_bytes=2 << 20) as server, node(tmp_path, 2) as peer:
            address = server.address or ""
            blob = server.blobs.put(data)
            async with peer.client.request(
                "GET", address, f"/v1/blobs/{blob}", headers={"Range": "bytes=100-199"}
            ) as response:
                seen["range"] = (response.status, await response.read())
                seen["content_range"] = response.headers["Content-Range"]
            # A pushed blob whose bytes do not hash to its id is refused and not stored.
            wrong = hashlib.sha256(b"something else").hexdigest()
            await peer.client.ensure_nonce(address)
            with pytest.raises(TransportError) as caught:
                async with peer.client.request(
                    "POST",
                    address,
                    "/v1/blobs",
                    headers={BLOB_ID_HEADER: wrong, "Content-Length": "5"},
                    data=b"hello",
                    ok=(201,),
                ):
                    pass
            seen["mismatch"] = str(caught.value)
            seen["stored_wrong"] = server.blobs.has(wrong)
            # Over the upload limit: refused before reading the body.
            big = hashlib.sha256(b"big").hexdigest()
            with pytest.raises(TransportError) as caught:
                async with peer.client.request(
                    "POST",
                    address,
                    "/v1/blobs",
                    headers={BLOB_ID_HEADER: big, "Content-Length": str(3 << 20)},
                    data=bytes(3 << 20),
                    ok=(201,),
                ):
                    pass
            seen["too_big"] = str(caught.value)
            # A good push is stored.
            good = peer.blobs.put(b"an update")
            seen["pushed"] = await peer.client.push_blob(address, good, peer.blobs.path(good))
            seen["stored_good"] = server.blobs.has(good)
            async with peer.client.session.get(address + "/metrics") as response:
                seen["metrics"] = await response.text()
        return seen

    seen = asyncio.run(scenario())
    assert seen["range"] == (206, data[100:200])
    assert seen["content_range"] == f"bytes 100-199/{len(data)}"
    assert "400" in str(seen["mismatch"]) and "hashes to" in str(seen["mismatch"])
    assert seen["stored_wrong"] is False
    assert "413" in str(seen["too_big"])
    assert seen["pushed"] is True and seen["stored_good"] is True
    assert "p2ptrain_server_blobs_received_total 1.0" in str(seen["metrics"])
    types = {f.name: f.type for f in text_string_to_metric_families(str(seen["metrics"]))}
    assert types["p2ptrain_server_blobs_received"] == "counter"
