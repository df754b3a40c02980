"""The certified head chain: extension, conflicts and catch-up from untrusted peers."""

from __future__ import annotations

from collections.abc import Sequence

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.identity import Identity
from p2ptrain.core.records import Head
from p2ptrain.protocol.chain import HeadChain, genesis_head, verify_link
from tests.support.builders import certify as certify_with
from tests.support.builders import child_head, experiment, h, identity

VALIDATORS = [identity(i) for i in range(5)]
MANIFEST = experiment(VALIDATORS, quorum=3)
GENESIS = genesis_head(MANIFEST)


def child(parent: Head, label: str = "a", height: int | None = None) -> Head:
    return child_head(parent, label, height)


def certify(head: Head, signers: Sequence[Identity] = VALIDATORS[:3]) -> QuorumCertificate:
    return certify_with(head, signers)


def three_links() -> list[tuple[Head, QuorumCertificate]]:
    one = child(GENESIS)
    two = child(one)
    three = child(two)
    return [(one, certify(one)), (two, certify(two)), (three, certify(three))]


def test_a_new_chain_starts_at_genesis() -> None:
    chain = HeadChain(MANIFEST)
    assert chain.height == 0
    assert chain.tip.head == GENESIS
    assert chain.tip.head_id == GENESIS.id
    assert chain.tip.certificate is None
    assert GENESIS.parent is None
    assert GENESIS.weights_blob == MANIFEST.genesis_weights
    assert GENESIS.experiment_id == MANIFEST.id
    assert chain.at(0) == chain.tip
    assert chain.at(1) is None
    assert chain.at(-1) is None
    assert chain.links_after(0) == []
    assert chain.conflicts == []


def test_a_certified_child_of_the_tip_extends_the_chain() -> None:
    chain = HeadChain(MANIFEST)
    one = child(GENESIS)
    certificate = certify(one)
    verdict = chain.extend(one, certificate)
    assert verdict.ok, verdict.reason
    assert verdict.reason.startswith("certified at height 1")
    assert chain.height == 1
    assert chain.tip.head == one
    assert chain.tip.head_id == one.id
    assert chain.tip.certificate == certificate
    two = child(one)
    assert chain.extend(two, certify(two, VALIDATORS[2:]))
    assert chain.height == 2


def test_extending_with_the_held_head_again_changes_nothing() -> None:
    chain = HeadChain(MANIFEST)
    one = child(GENESIS)
    assert chain.extend(one, certify(one))
    again = chain.extend(one, certify(one, VALIDATORS[1:4]))
    assert not again
    assert again.reason == "head at height 1 already adopted"
    assert chain.height == 1
    assert chain.conflicts == []


def test_a_head_with_the_wrong_parent_is_refused() -> None:
    chain = HeadChain(MANIFEST)
    orphan = Head(
        experiment_id=MANIFEST.id,
        height=1,
        parent=h("not genesis"),
        weights_blob=h("weights"),
        optimizer_blob=None,
        aggregate_blob=h("aggregate"),
    )
    verdict = chain.extend(orphan, certify(orphan))
    assert not verdict
    assert "does not extend" in verdict.reason
    assert verdict.reason.startswith(f"head {orphan.id[:12]} at height 1")
    assert chain.height == 0


def test_a_head_that_skips_a_height_is_refused() -> None:
    chain = HeadChain(MANIFEST)
    skipping = child(GENESIS, height=2)
    verdict = chain.extend(skipping, certify(skipping))
    assert not verdict
    assert "does not extend" in verdict.reason
    assert chain.height == 0


def test_a_certificate_for_another_head_is_refused() -> None:
    chain = HeadChain(MANIFEST)
    one, sibling = child(GENESIS, "a"), child(GENESIS, "b")
    verdict = chain.extend(one, certify(sibling))
    assert not verdict
    assert verdict.reason == "certificate names another head or height"
    assert chain.height == 0


def test_an_uncertified_head_is_refused() -> None:
    chain = HeadChain(MANIFEST)
    one = child(GENESIS)
    verdict = chain.extend(one, certify(one, VALIDATORS[:2]))
    assert not verdict
    assert verdict.reason == "certificate does not verify: 2 validator signatures, quorum is 3"
    assert chain.height == 0


def test_a_certificate_signed_by_outsiders_is_refused() -> None:
    chain = HeadChain(MANIFEST)
    one = child(GENESIS)
    verdict = chain.extend(one, certify(one, [identity(100 + i) for i in range(3)]))
    assert not verdict
    assert "not a validator of the experiment" in verdict.reason
    assert chain.height == 0


def test_a_head_of_another_experiment_is_refused() -> None:
    chain = HeadChain(MANIFEST)
    stranger = Head(
        experiment_id=h("another experiment"),
        height=1,
        parent=GENESIS.id,
        weights_blob=h("weights"),
        optimizer_blob=None,
        aggregate_blob=h("aggregate"),
    )
    verdict = chain.extend(stranger, certify(stranger))
    assert not verdict
    assert verdict.reason == "head is for another experiment"


def test_a_second_certified_head_at_a_held_height_is_a_recorded_conflict() -> None:
    chain = HeadChain(MANIFEST)
    one, sibling = child(GENESIS, "a"), child(GENESIS, "b")
    assert chain.extend(one, certify(one))
    sibling_certificate = certify(sibling, VALIDATORS[2:])
    verdict = chain.extend(sibling, sibling_certificate)
    assert not verdict
    assert verdict.reason == "SAFETY: a second certified head at height 1"
    assert len(chain.conflicts) == 1
    held, second = chain.conflicts[0]
    assert held.head == one
    assert second.head == sibling
    assert second.head_id == sibling.id
    assert second.certificate == sibling_certificate
    assert chain.tip.head == one  # the first stays


def test_an_uncertified_sibling_is_not_a_conflict() -> None:
    chain = HeadChain(MANIFEST)
    one, sibling = child(GENESIS, "a"), child(GENESIS, "b")
    assert chain.extend(one, certify(one))
    verdict = chain.extend(sibling, certify(sibling, VALIDATORS[:2]))
    assert not verdict
    assert verdict.reason == "height 1 is already certified"
    assert chain.conflicts == []


def test_catch_up_adopts_a_valid_chain() -> None:
    links = three_links()
    checked: list[Head] = []

    def weights_ok(head: Head) -> bool:
        checked.append(head)
        return True

    chain = HeadChain(MANIFEST)
    verdict = chain.catch_up(links, weights_ok)
    assert verdict.ok, verdict.reason
    assert verdict.reason == "caught up 3 heads to height 3"
    assert checked == [links[-1][0]]
    assert chain.height == 3
    assert chain.tip.head == links[-1][0]
    for height, (head, certificate) in enumerate(links, start=1):
        link = chain.at(height)
        assert link is not None
        assert link.head == head
        assert link.certificate == certificate


def test_catch_up_skips_the_heads_already_held() -> None:
    links = three_links()
    chain = HeadChain(MANIFEST)
    assert chain.extend(*links[0])
    verdict = chain.catch_up(links, lambda head: True)
    assert verdict.ok, verdict.reason
    assert verdict.reason == "caught up 2 heads to height 3"
    assert chain.tip.head == links[-1][0]


def test_catch_up_from_a_chain_no_longer_than_ours_adopts_nothing() -> None:
    links = three_links()
    chain = HeadChain(MANIFEST)
    assert chain.catch_up(links, lambda head: True)
    verdict = chain.catch_up(links, lambda head: True)
    assert not verdict
    assert verdict.reason == "the peer's chain is not longer than ours"
    empty = chain.catch_up([], lambda head: True)
    assert not empty
    assert empty.reason == "no heads to catch up with"
    assert chain.height == 3


def test_catch_up_rejects_the_whole_chain_if_a_link_is_bad() -> None:
    one, two, three = (head for head, _ in three_links())
    bad_chains = {
        "q-1 signatures": [
            (one, certify(one)),
            (two, certify(two, VALIDATORS[:2])),
            (three, certify(three)),
        ],
        "certificate of another head": [
            (one, certify(one)),
            (two, certify(three)),
            (three, certify(three)),
        ],
        "a gap": [(one, certify(one)), (three, certify(three))],
        "a forged last link": [
            (one, certify(one)),
            (two, certify(two)),
            (child(one, "forged", height=3), certify(child(one, "forged", height=3))),
        ],
    }
    for name, links in bad_chains.items():
        chain = HeadChain(MANIFEST)
        verdict = chain.catch_up(links, lambda head: True)
        assert not verdict, name
        assert verdict.reason.startswith("catch-up rejected at height "), name
        assert chain.height == 0, name
        assert chain.tip.head == GENESIS, name
        assert chain.at(1) is None, name


def test_catch_up_rejects_the_whole_chain_if_the_weights_do_not_match() -> None:
    chain = HeadChain(MANIFEST)
    verdict = chain.catch_up(three_links(), lambda head: False)
    assert not verdict
    assert verdict.reason == "catch-up rejected: the final weights do not match the head"
    assert chain.height == 0
    assert chain.tip.head == GENESIS


def test_links_after_hands_a_peer_what_it_lacks() -> None:
    links = three_links()
    chain = HeadChain(MANIFEST)
    assert chain.catch_up(links, lambda head: True)
    assert chain.links_after(0) == links
    assert chain.links_after(1) == links[1:]
    assert chain.links_after(3) == []
    follower = HeadChain(MANIFEST)
    assert follower.catch_up(chain.links_after(follower.height), lambda head: True)
    assert follower.tip == chain.tip


def test_verify_link_names_the_parent_it_checks_against() -> None:
    one = child(GENESIS)
    ok = verify_link(MANIFEST, (GENESIS.id, 0), one, certify(one), experiment_id=MANIFEST.id)
    assert ok.ok, ok.reason
    wrong = verify_link(MANIFEST, (GENESIS.id, 1), one, certify(one), experiment_id=MANIFEST.id)
    assert not wrong
    assert "does not extend" in wrong.reason


def test_links_after_a_negative_height_is_every_certified_head() -> None:
    links = three_links()
    chain = HeadChain(MANIFEST)
    assert chain.catch_up(links, lambda head: True)
    assert chain.links_after(-1) == links
    assert chain.links_after(-2) == links
