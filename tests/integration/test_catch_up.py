"""A late joiner catches up the certified head chain over HTTP and verifies every link; a
peer serving a tampered chain is not believed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.core.records import Head
from p2ptrain.net.node import NetNode
from p2ptrain.protocol.chain import HeadChain
from p2ptrain.store.blobs import BlobStore
from tests.support.builders import certified_chain, experiment, h, identity

pytestmark = pytest.mark.integration

VALIDATORS = [identity(i) for i in range(4)]
MANIFEST = experiment(VALIDATORS, quorum=3)
NETWORK = NetworkManifest(name="catch-up", authority=identity(99).public_key)


def chain_of(length: int) -> HeadChain:
    return certified_chain(MANIFEST, VALIDATORS[:3], length)


class TamperedChain(HeadChain):
    """Serves an honest chain with the weights of height 2 swapped (certificate kept)."""

    def links_after(self, height: int) -> list[tuple[Head, QuorumCertificate]]:
        return [
            (msgspec.structs.replace(head, weights_blob=h("stolen")), certificate)
            if head.height == 2
            else (head, certificate)
            for head, certificate in super().links_after(height)
        ]


async def catch_up(tmp_path: Path, served: HeadChain) -> tuple[str, int]:
    async with (
        NetNode(identity=identity(50), network=NETWORK, blobs=BlobStore(tmp_path / "a")) as old,
        NetNode(identity=identity(51), network=NETWORK, blobs=BlobStore(tmp_path / "b")) as late,
    ):
        old.serve_chain(served)
        mine = HeadChain(MANIFEST)
        page = await late.client.head_links(old.address or "", MANIFEST.id, after=mine.height)
        links = page.links
        verdict = mine.catch_up(
            links, lambda head: head.weights_blob == h(f"weights-{head.height}-a")
        )
        return verdict.reason, mine.height


def test_a_late_joiner_catches_up_and_verifies(tmp_path: Path) -> None:
    reason, height = asyncio.run(catch_up(tmp_path, chain_of(5)))
    assert (reason, height) == ("caught up 5 heads to height 5", 5)


def test_a_tampered_chain_is_rejected(tmp_path: Path) -> None:
    liar = TamperedChain(MANIFEST)
    honest = chain_of(3)
    for head, certificate in honest.links_after(0):
        assert liar.extend(head, certificate)
    reason, height = asyncio.run(catch_up(tmp_path, liar))
    assert height == 0
    assert "catch-up rejected at height 2" in reason
