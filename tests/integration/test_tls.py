"""Optional TLS: the self-signed certificate's fingerprint is pinned in the node's address
and signed peer record; a peer with the wrong pin cannot connect."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.errors import TransportError
from p2ptrain.net.config import NetConfig
from p2ptrain.net.node import NetNode
from p2ptrain.store.blobs import BlobStore
from tests.support.builders import identity

pytestmark = pytest.mark.integration

NETWORK = NetworkManifest(name="tls", authority=identity(99).public_key)


async def scenario(tmp_path: Path) -> tuple[str, str, str | None]:
    server = NetNode(
        identity=identity(1),
        network=NETWORK,
        blobs=BlobStore(tmp_path / "s"),
        config=NetConfig(tls=True),
    )
    async with (
        server,
        NetNode(identity=identity(2), network=NETWORK, blobs=BlobStore(tmp_path / "c")) as client,
    ):
        address = server.address or ""
        peer = await client.connect(address)
        record = server.self_record().record
        wrong = address.split("#")[0] + "#sha256=" + "0" * 64
        with pytest.raises(TransportError) as caught:
            await client.client.peer_records(wrong)
        return peer, str(caught.value), record.tls_fingerprint


def test_a_pinned_certificate_connects_and_a_wrong_pin_is_refused(tmp_path: Path) -> None:
    peer, error, fingerprint = asyncio.run(scenario(tmp_path))
    assert peer == identity(1).peer_id
    assert fingerprint is not None and len(fingerprint) == 64
    assert "fingerprint" in error.lower()
