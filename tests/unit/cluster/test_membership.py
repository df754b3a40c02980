"""The cluster's membership rules: seniority, election, planning a generation, and when to
form, re-form or give up. Every expected value is worked out by hand from the rules in
:mod:`p2ptrain.cluster.membership`'s docstring."""

from __future__ import annotations

import pytest

from p2ptrain.cluster.membership import (
    GenerationPlan,
    Member,
    decide_forming,
    decide_reform,
    decide_refused,
    elect,
    lost_members,
    next_generation,
    plan_generation,
    seniority,
)
from p2ptrain.cluster.settings import AUTO_COMPRESS_BELOW, choose_compression


def member(peer: str, since: int | None = None, step: int = 0, generation: int = -1) -> Member:
    return Member(peer, f"10.0.0.{ord(peer[0]) - 96}:7000", since, step, generation)


def test_seniority_puts_the_longest_in_first_and_ties_by_peer_id() -> None:
    veteran, elder, newer, fresh_a, fresh_b = (
        member("e", since=0),
        member("f", since=0),
        member("a", since=2),
        member("b"),
        member("c"),
    )
    ranked = sorted([fresh_b, newer, elder, fresh_a, veteran], key=seniority)
    assert [m.peer_id for m in ranked] == ["e", "f", "a", "b", "c"]
    assert elect([fresh_b, newer, elder, fresh_a, veteran]) == veteran


def test_nobody_trained_yet_the_lowest_peer_id_leads() -> None:
    assert elect([member("c"), member("a"), member("b")]).peer_id == "a"


def test_the_survivors_elect_the_same_next_leader_and_a_joiner_never_leads_them() -> None:
    # Generation 0 of a, b, c (all since 0); a leads. a dies; d is new.
    b, c, d = member("b", since=0), member("c", since=0), member("d")
    assert elect([c, b]).peer_id == "b"
    assert elect([d, c, b]).peer_id == "b"
    # d joined in generation 3, a restarted member (a, never trained since) came later.
    assert elect([member("d", since=3), member("a")]).peer_id == "d"


def test_elect_needs_a_member() -> None:
    with pytest.raises(ValueError, match="at least one member"):
        elect([])


def test_next_generation_is_one_past_the_last_any_member_was_in() -> None:
    assert next_generation([member("a"), member("b")]) == 0
    assert next_generation([member("a", generation=4), member("b", generation=2)]) == 5
    assert next_generation([]) == 0


def test_plan_ranks_by_seniority_and_starts_from_the_highest_completed_step() -> None:
    leader = member("b", since=0, step=40, generation=1)
    others = [
        member("d", since=None, step=0),  # the joiner
        member("c", since=0, step=41, generation=1),  # completed the step in flight
        member("e", since=1, step=40, generation=1),
        leader,  # a duplicate of the leader is ignored
    ]
    plan = plan_generation(2, leader, others)
    assert plan == GenerationPlan(
        number=2,
        leader="b",
        members=("b", "c", "e", "d"),
        since=(0, 0, 1, 2),
        source_rank=1,
        start_step=41,
    )
    assert plan.world == 4
    assert plan.rank_of("d") == 3
    assert plan.rank_of("a") is None


def test_on_a_tie_the_leader_is_the_source_then_the_most_senior() -> None:
    leader = member("b", since=0, step=7)
    tied = plan_generation(1, leader, [member("a", since=1, step=7), member("c", since=0)])
    assert (tied.members, tied.source_rank, tied.start_step) == (("b", "c", "a"), 0, 7)
    ahead = [member("c", since=0, step=7), member("a", since=1, step=7)]
    behind = plan_generation(1, member("b", since=0, step=3), ahead)
    assert (behind.members, behind.source_rank, behind.start_step) == (("b", "c", "a"), 1, 7)


def forming(now: float, **overrides: object) -> tuple[bool, str]:
    arguments: dict[str, object] = {
        "forming_since": 10.0,
        "not_before": 13.0,
        "settle_s": 3.0,
        "alive": {"b", "c"},
        "asked": {"b"},
        "wait_for": 1,
        "first": True,
    } | overrides
    return decide_forming(now, **arguments)  # type: ignore[arg-type]


def test_the_first_generation_waits_for_discovery_and_for_wait_for_members() -> None:
    assert forming(12.0, asked={"b", "c"}) == (False, "searching the LAN for members (3 so far)")
    assert forming(14.0, asked={"b"}, alive={"b"}, wait_for=3) == (
        False,
        "waiting for members: 2 of --wait-for 3 are ready",
    )
    assert forming(14.0, asked={"b", "c"}, wait_for=3) == (
        True,
        "every member alive is ready (3)",
    )


def test_a_leader_waits_settle_s_for_the_alive_then_forms_without_them() -> None:
    assert forming(12.5, first=False) == (False, "waiting up to 3 s for 1 more member(s) to ask")
    decided, reason = forming(13.0, first=False)
    assert decided and reason.startswith("forming with the 2 ready; 1 alive did not ask")


def test_after_the_first_generation_a_lone_survivor_forms_at_once() -> None:
    # wait_for and discovery count only for the first generation.
    assert forming(10.0, first=False, alive=set(), asked=set(), wait_for=3) == (
        True,
        "every member alive is ready (1)",
    )


def test_reform_when_someone_waits_to_join_or_this_member_leaves() -> None:
    members = ("a", "b")
    assert decide_reform(members, [], leaving=False) == (False, "the member set is unchanged")
    # A member of the generation asking again means its generation failed: no vote for it.
    assert decide_reform(members, ["b"], leaving=False) == (False, "the member set is unchanged")
    assert decide_reform(members, ["b", "d"], leaving=False) == (
        True,
        "1 member(s) waiting to join: d",
    )
    assert decide_reform(members, [], leaving=True) == (True, "this member is leaving")


def test_give_up_only_when_nobody_proved_the_secret_and_somebody_refused() -> None:
    differing = {"10.0.0.2:7000": "the cluster secret differs: ..."}
    base: dict[str, object] = {"not_before": 5.0, "trained": False, "proven": 0}
    assert decide_refused(6.0, differing=differing, **base) == (  # type: ignore[arg-type]
        "refused by the members at 10.0.0.2:7000: the cluster secret differs: ..."
    )
    assert decide_refused(4.0, differing=differing, **base) is None  # type: ignore[arg-type]
    assert decide_refused(6.0, differing={}, **base) is None  # type: ignore[arg-type]
    assert decide_refused(6.0, differing=differing, **(base | {"proven": 1})) is None  # type: ignore[arg-type]
    assert decide_refused(6.0, differing=differing, **(base | {"trained": True})) is None  # type: ignore[arg-type]


def test_lost_members_are_the_previous_ones_not_alive_but_never_oneself() -> None:
    assert lost_members(("a", "b", "c"), {"b"}, me="c") == ["a"]
    assert lost_members(("a", "b"), {"a", "b"}, me="a") == []


def test_auto_compresses_only_on_links_slower_than_the_threshold() -> None:
    assert choose_compression(12e6) == "powersgd"  # 100 Mbit/s
    assert choose_compression(AUTO_COMPRESS_BELOW * 0.99) == "powersgd"
    assert choose_compression(AUTO_COMPRESS_BELOW) == "none"
    assert choose_compression(1.2e9) == "none"  # loopback
