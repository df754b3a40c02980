"""Catch-up at any distance: a follower far behind verifies the certified chain page after
page, then fetches a state its provider still holds (never one every node collected), says
that it is catching up while it is, and says once when nobody holds the state it needs."""

from __future__ import annotations

import msgspec
import torch

from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.tensors import encode_state_dict
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.chain import MAX_LINKS_PER_PAGE, ChainPage, HeadChain, genesis_head
from p2ptrain.protocol.effects import ChainFetch, Fetch, StateFetch
from p2ptrain.protocol.follower import Follower
from p2ptrain.protocol.policy import CATCH_UP_RETRY_S, STATE_ATTEMPTS, RolePolicy
from p2ptrain.sim.workloads import SyntheticWorkload
from tests.support.builders import certify, child_head, identity, synthetic_experiment

VALIDATOR = identity(0)
PROVIDER = identity(9).public_key
WORKLOAD = SyntheticWorkload(seed=5)
MANIFEST = synthetic_experiment(WORKLOAD, VALIDATOR.public_key, max_updates=4)
LENGTH = 2 * MAX_LINKS_PER_PAGE + 88  # three pages


def provider_chain(states: set[int]) -> tuple[HeadChain, dict[int, bytes]]:
    """A certified chain of :data:`LENGTH` heads; the heads at ``states`` carry real
    weights (their encoded blobs returned), the others names of blobs nobody holds."""
    chain, head, blobs = HeadChain(MANIFEST), genesis_head(MANIFEST), {}
    for height in range(1, LENGTH + 1):
        head = child_head(head)
        if height in states:
            weights = {k: v + height for k, v in WORKLOAD.genesis().items()}
            blobs[height] = bytes(encode_state_dict(weights))
            head = msgspec.structs.replace(head, weights_blob=sha256_hex(blobs[height]))
        assert chain.extend(head, certify(head, [VALIDATOR]))
    return chain, blobs


def page_of(chain: HeadChain, after: int, held: set[int]) -> ChainPage:
    links = tuple(chain.links_after(after)[:MAX_LINKS_PER_PAGE])
    return ChainPage(links, chain.height, frozenset(held), PROVIDER)


def test_a_follower_far_behind_pages_to_the_tip_and_fetches_a_held_state() -> None:
    tip = LENGTH
    chain, blobs = provider_chain({tip})
    held = {tip - 2, tip - 1, tip}  # what --keep-heads 3 leaves
    follower = Follower(MANIFEST, identity(7), WORKLOAD.genesis())

    asked = 0
    for expected in (MAX_LINKS_PER_PAGE, 2 * MAX_LINKS_PER_PAGE):
        (ask,) = follower.receive_links(1.0, page_of(chain, asked, held))
        assert ask == act.FetchChain(PROVIDER, expected)  # the next page, from the same peer
        asked = ask.after_height
        assert follower.chain.height == expected and follower.base.head.height == 0
        assert follower.catching_up == (
            f"catching up: at height 0, tip {tip}, certified links verified to {expected}"
        )

    (fetch,) = follower.receive_links(1.0, page_of(chain, asked, held))
    assert isinstance(fetch, act.FetchState)  # never the aggregate of a head long collected
    assert (fetch.peer, fetch.head.height) == (PROVIDER, tip)
    assert follower.catching_up == f"catching up: at height 0, tip {tip}"

    (adopted,) = follower.receive_state(2.0, fetch.head_id, blobs[tip], None)
    assert isinstance(adopted, act.Adopted) and adopted.head.height == tip
    assert follower.base.head_id == chain.tip.head_id
    assert torch.equal(follower.base.weights["w"], WORKLOAD.genesis()["w"] + tip)
    assert follower.catching_up == ""


def test_a_provider_without_the_tip_state_serves_a_held_head_then_the_tip_follows() -> None:
    """The provider's newest state is below its tip (it is catching up itself): that head
    is adopted first, and the heads after it follow by their aggregates, asked of anyone."""
    tip = LENGTH
    chain, blobs = provider_chain({tip - 3})
    follower = Follower(MANIFEST, identity(7), WORKLOAD.genesis())
    follower.chain.extend_links(chain.links_after(0)[: 2 * MAX_LINKS_PER_PAGE])

    (fetch,) = follower.receive_links(1.0, page_of(chain, 2 * MAX_LINKS_PER_PAGE, {tip - 3}))
    assert isinstance(fetch, act.FetchState) and fetch.head.height == tip - 3
    adopted, following = follower.receive_state(2.0, fetch.head_id, blobs[tip - 3], None)
    assert isinstance(adopted, act.Adopted) and adopted.head.height == tip - 3
    assert isinstance(following, act.FetchAggregate)
    assert (following.peer, following.head.height) == (None, tip - 2)
    assert follower.catching_up == f"catching up: at height {tip - 3}, tip {tip}"


def test_a_tampered_page_is_refused_whole_and_blamed() -> None:
    chain, _ = provider_chain(set())
    links = list(chain.links_after(0)[:MAX_LINKS_PER_PAGE])
    head, certificate = links[100]
    links[100] = (msgspec.structs.replace(head, weights_blob="0" * 64), certificate)
    follower = Follower(MANIFEST, identity(7), WORKLOAD.genesis())

    page = ChainPage(tuple(links), chain.height, frozenset(), PROVIDER)
    (reported,) = follower.receive_links(1.0, page)
    assert isinstance(reported, act.Reported)
    assert "catch-up rejected at height 101" in reported.reason
    assert follower.chain.height == 0  # nothing of the page adopted


def test_a_state_nobody_holds_is_said_once_and_asked_for_again_after_a_while() -> None:
    tip = LENGTH
    chain, blobs = provider_chain({tip})
    follower = Follower(MANIFEST, identity(7), WORKLOAD.genesis())
    policy = RolePolicy(follower)

    effects = policy.links(0.0, page_of(chain, 0, set()))
    assert [type(e.request) for e in effects if isinstance(e, Fetch)] == [ChainFetch]
    # another certificate far ahead while the page is in flight asks nothing more
    assert policy.carry(0.1, [act.FetchChain(PROVIDER, 0)]) == []
    fetched = policy.fetched(0.2, ChainFetch(None, MAX_LINKS_PER_PAGE), page_of(chain, 256, set()))
    fetched = policy.fetched(0.3, ChainFetch(None, 512), page_of(chain, 512, set()))
    (state_fetch,) = fetched
    assert isinstance(state_fetch, Fetch) and isinstance(state_fetch.request, StateFetch)
    request = state_fetch.request
    assert request.head.height == tip and request.first == ()  # held nowhere said: anyone

    now, notices = 1.0, []
    for _ in range(STATE_ATTEMPTS):
        effects = policy.fetch_failed(now, request, proven_bad=False)
        retries = [e for e in effects if isinstance(e, Fetch)]
        notices += [e for e in effects if isinstance(e, act.Notice)]
        if retries:
            (retry,) = retries
            assert isinstance(retry.request, StateFetch)
            request = retry.request
        now += 1.0
    (notice,) = notices
    assert notice.reason.startswith(f"catching up: at height 0, tip {tip}; no provider holds")
    assert follower.statistics().catching_up == notice.reason

    assert policy.tick(now) == []  # backing off
    (again,) = policy.tick(now + CATCH_UP_RETRY_S)
    assert isinstance(again, Fetch) and isinstance(again.request, StateFetch)
    assert again.request.head.height == tip
    policy.fetched(now + 11, again.request, (blobs[tip], None))
    assert follower.base.head.height == tip and follower.catching_up == ""


def test_a_next_page_that_does_not_come_moves_the_base_to_what_was_verified() -> None:
    """A provider named a tip it then did not serve (it went away, or it lied): the base
    goes on towards the verified chain's tip, and the status no longer counts on the tip
    that was only named."""
    chain, blobs = provider_chain({MAX_LINKS_PER_PAGE})
    follower = Follower(MANIFEST, identity(7), WORKLOAD.genesis())
    policy = RolePolicy(follower)
    claimed = ChainPage(
        tuple(chain.links_after(0)[:MAX_LINKS_PER_PAGE]), 10**9, frozenset(), PROVIDER
    )
    (next_page,) = policy.links(0.0, claimed)
    assert isinstance(next_page, Fetch) and isinstance(next_page.request, ChainFetch)
    assert f"tip {10**9}" in follower.catching_up

    (state_fetch,) = policy.fetch_failed(1.0, next_page.request, proven_bad=False)
    assert isinstance(state_fetch, Fetch) and isinstance(state_fetch.request, StateFetch)
    assert state_fetch.request.head.height == MAX_LINKS_PER_PAGE
    assert follower.catching_up == f"catching up: at height 0, tip {MAX_LINKS_PER_PAGE}"
    policy.fetched(2.0, state_fetch.request, (blobs[MAX_LINKS_PER_PAGE], None))
    assert follower.base.head.height == MAX_LINKS_PER_PAGE and follower.catching_up == ""
