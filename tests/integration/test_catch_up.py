"""A late joiner catches up the certified head chain over HTTP and verifies every link; a
peer serving a tampered chain is not believed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.envelope import seal
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.core.records import Attestation, Head
from p2ptrain.net.node import NetNode
from p2ptrain.protocol.chain import HeadChain, genesis_head
from p2ptrain.store.blobs import BlobStore
from tests.support.builders import experiment, h, identity

pytestmark = pytest.mark.integration

VALIDATORS = [identity(i) for i in range(4)]
MANIFEST = experiment(VALIDATORS, quorum=3)
NETWORK = NetworkManifest(name="catch-up", authority=identity(99).public_key)


def certified_chain(length: int) -> HeadChain:
    chain = HeadChain(MANIFEST)
    parent = genesis_head(MANIFEST)
    for height in range(1, length + 1):
        head = Head(
            experiment_id=MANIFEST.id,
            height=height,
            parent=parent.id,
            weights_blob=h(f"weights-{height}"),
            optimizer_blob=None,
            accepted=(h(f"update-{height}"),),
        )
        assert chain.extend(head, certify(head))
        parent = head
    return chain


def certify(head: Head) -> QuorumCertificate:
    return QuorumCertificate.assemble(
        seal(
            v,
            Attestation(
                experiment_id=head.experiment_id,
                height=head.height,
                head_id=head.id,
                validator=v.public_key,
            ),
        )
        for v in VALIDATORS[:3]
    )


async def catch_up(tmp_path: Path, served: HeadChain) -> tuple[str, int]:
    async with (
        NetNode(identity=identity(50), network=NETWORK, blobs=BlobStore(tmp_path / "a")) as old,
        NetNode(identity=identity(51), network=NETWORK, blobs=BlobStore(tmp_path / "b")) as late,
    ):
        old.serve_chain(served)
        mine = HeadChain(MANIFEST)
        links = await late.client.head_links(old.address or "", MANIFEST.id, after=mine.height)
        verdict = mine.catch_up(
            links, lambda head: head.weights_blob == h(f"weights-{head.height}")
        )
        return verdict.reason, mine.height


def test_a_late_joiner_catches_up_and_verifies(tmp_path: Path) -> None:
    reason, height = asyncio.run(catch_up(tmp_path, certified_chain(5)))
    assert (reason, height) == ("caught up 5 heads to height 5", 5)


def test_a_tampered_chain_is_rejected(tmp_path: Path) -> None:
    honest = certified_chain(3)
    liar = HeadChain(MANIFEST)
    links = honest.links_after(0)
    # The liar swaps the weights of height 2 but keeps its certificate: the link breaks.
    forged = msgspec.structs.replace(links[1][0], weights_blob=h("stolen"))
    liar._links.extend(
        [honest.at(1), type(honest.at(1))(forged, forged.id, links[1][1])]  # type: ignore[list-item,arg-type,misc]
    )
    reason, height = asyncio.run(catch_up(tmp_path, liar))
    assert height == 0
    assert "catch-up rejected at height 2" in reason
