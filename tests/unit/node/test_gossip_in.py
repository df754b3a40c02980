"""The node's experiment-topic validator for certificates: a head it holds certified already
goes no further (each validator assembles its own certificate; one per head is enough),
blaming nobody; a new head's certificate is judged as before; and a trainer-only node asks
its neighbours to skip the consensus traffic."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from p2ptrain.core.certificate import CertifiedLink
from p2ptrain.net.gossip import CERTIFICATE_KIND, Delivered, Refusal
from p2ptrain.node.gossip_in import GossipIn, gossip_skip
from tests.support.builders import certified_chain, certify, child_head, experiment, identity

VALIDATORS = [identity(i) for i in range(3)]
MANIFEST = experiment(VALIDATORS, 2)
TOPIC = "exp/" + MANIFEST.id


def _gossip_in() -> tuple[GossipIn, Any]:
    chain = certified_chain(MANIFEST, VALIDATORS[:2], 2)
    follower = SimpleNamespace(chain=chain, manifest=MANIFEST, experiment_id=MANIFEST.id)
    gossip = GossipIn(
        intake=None,  # type: ignore[arg-type]  # certificates never reach the intake rules
        runners=(),
        services=SimpleNamespace(store=None),  # type: ignore[arg-type]
        reports=SimpleNamespace(follower=follower),  # type: ignore[arg-type]
        archive=False,
    )
    return gossip, chain


def _delivered(link: CertifiedLink) -> Delivered:
    return Delivered(TOPIC, CERTIFICATE_KIND, b"", link, from_peer="neighbour")


def test_another_certificate_of_a_held_head_is_ignored_blaming_nobody() -> None:
    gossip, chain = _gossip_in()
    held = chain.at(2)
    other_quorum = certify(held.head, VALIDATORS[1:])  # not the certificate the chain holds
    assert other_quorum != held.certificate
    verdict = gossip.check(_delivered(CertifiedLink(head=held.head, certificate=other_quorum)))
    assert isinstance(verdict, Refusal) and verdict.blame is None
    assert "certified here already" in verdict.reason


def test_the_next_heads_certificate_is_judged_as_before() -> None:
    gossip, chain = _gossip_in()
    following = child_head(chain.at(2).head)
    good = CertifiedLink(head=following, certificate=certify(following, VALIDATORS[:2]))
    assert gossip.check(_delivered(good)) is None
    short = CertifiedLink(head=following, certificate=certify(following, VALIDATORS[:1]))
    verdict = gossip.check(_delivered(short))
    assert isinstance(verdict, str) and verdict.startswith("bad certificate")


def test_only_a_node_that_only_trains_skips_the_consensus_traffic() -> None:
    assert gossip_skip(("trainer",)) == ("attestation", "proposal", "update")
    assert gossip_skip(("trainer", "validator")) == ()
    assert gossip_skip(("seed",)) == ()
