"""Screening updates from their tensors: each rejection has a reason, order never matters."""

from __future__ import annotations

import random

import pytest
import torch

from p2ptrain.aggregate.cohort import Contribution
from p2ptrain.aggregate.rules import RankedRule, make_rule
from p2ptrain.aggregate.rules_basic import Ranked
from p2ptrain.aggregate.screening import (
    Candidate,
    Centre,
    _centre_products,
    check_structure,
    measure,
    measure_with_centre,
    screen_cohort,
)
from p2ptrain.core.manifests import AggregationSpec, ScreeningSpec
from p2ptrain.core.reasons import describe
from p2ptrain.core.tensors import schema_of

SEED = 20261121
SPEC = ScreeningSpec(max_norm_ratio=3.0, min_cosine=0.0)


def honest_cohort(n: int, seed: int = SEED) -> list[Candidate]:
    """n updates around a common direction, as honest trainers would send."""
    generator = torch.Generator().manual_seed(seed)
    direction = {
        "w": torch.randn(4, 5, generator=generator),
        "b": torch.randn(5, generator=generator),
    }
    cohort = []
    for i in range(n):
        tensors = {
            name: value + 0.3 * torch.randn(value.shape, generator=generator)
            for name, value in direction.items()
        }
        cohort.append(Candidate(f"{i:064x}", tensors))
    return cohort


SCHEMA = schema_of(honest_cohort(1)[0].tensors)


def verdict_of(outcome, update_id):  # type: ignore[no-untyped-def]
    return next(v for v in outcome.verdicts if v.update_id == update_id)


def test_an_honest_cohort_passes_whole() -> None:
    outcome = screen_cohort(honest_cohort(8), SCHEMA, SPEC)
    assert all(v.accepted for v in outcome.verdicts), f"seed={SEED}: {outcome.verdicts}"
    assert len(outcome.contributions) == 8
    assert not outcome.failures


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda t: {**t, "w": t["w"].double()}, "parameter 'w' is not float32"),
        (lambda t: {**t, "w": t["w"].reshape(5, 4)}, "parameter 'w' does not have the model's"),
        (lambda t: {"w": t["w"]}, "do not match the model schema"),
        (lambda t: {**t, "extra": torch.zeros(1)}, "do not match the model schema"),
        (lambda t: {**t, "b": torch.full((5,), float("nan"))}, "NaN or infinite"),
        (lambda t: {**t, "b": torch.full((5,), float("inf"))}, "NaN or infinite"),
        (lambda t: {k: v * 10 for k, v in t.items()}, "exceeds 3.0x"),
        (lambda t: {k: v * 0.01 for k, v in t.items()}, "below 1/3.0"),
        (lambda t: {k: -v for k, v in t.items()}, "cosine"),
    ],
)
def test_each_bad_update_is_rejected_with_its_reason(mutate, reason) -> None:  # type: ignore[no-untyped-def]
    cohort = honest_cohort(7)
    bad = Candidate("f" * 64, mutate(dict(cohort[0].tensors)))
    outcome = screen_cohort([*cohort, bad], SCHEMA, SPEC)
    verdict = verdict_of(outcome, bad.update_id)
    assert not verdict.accepted, f"seed={SEED}"
    assert verdict.reason is not None and reason in describe(verdict.reason)
    assert [f.update_id for f in outcome.failures] == [bad.update_id]
    assert len(outcome.contributions) == 7


def test_verdicts_do_not_depend_on_arrival_order() -> None:
    cohort = honest_cohort(9)
    cohort.append(Candidate("e" * 64, {k: v * 10 for k, v in cohort[0].tensors.items()}))
    cohort.append(Candidate("d" * 64, {k: -v for k, v in cohort[1].tensors.items()}))
    reference = screen_cohort(cohort, SCHEMA, SPEC)
    for trial in range(5):
        shuffled = cohort[:]
        random.Random(SEED + trial).shuffle(shuffled)
        again = screen_cohort(shuffled, SCHEMA, SPEC)
        assert again.verdicts == reference.verdicts, f"seed={SEED + trial}"
        assert [c.update_id for c in again.contributions] == [
            c.update_id for c in reference.contributions
        ]


def test_structure_check_accepts_a_matching_update() -> None:
    assert check_structure(honest_cohort(1)[0].tensors, SCHEMA) is None


def test_an_empty_cohort_screens_to_nothing() -> None:
    outcome = screen_cohort([], SCHEMA, SPEC)
    assert outcome.verdicts == () and outcome.contributions == () and outcome.failures == ()


@pytest.mark.parametrize(("n", "length"), [(1, 70_000), (5, 3 * 65_536 + 123), (16, 140_000)])
def test_the_first_pass_with_the_centre_gives_the_bits_of_two_passes(n: int, length: int) -> None:
    """measure_with_centre: the norms of measure() and the centre products of the separate
    centre pass, bit for bit (random values, -0.0 and zeros among them)."""
    generator = torch.Generator().manual_seed(SEED + n)
    vectors = [torch.randn(length, generator=generator) * (1 + i) for i in range(n)]
    vectors[0][:7] = -0.0
    vectors[-1][100:200] = 0.0
    ahead = measure_with_centre(vectors)
    assert ahead is not None, "the kernel is installed in the tests"
    assert ahead.mean is None
    assert ahead.norms == measure(vectors), f"seed={SEED + n}"
    assert (list(ahead.dots), ahead.centre_norm) == _centre_products(vectors), f"seed={SEED + n}"


@pytest.mark.parametrize(("n", "length"), [(1, 70_000), (5, 3 * 65_536 + 123), (16, 140_000)])
@pytest.mark.parametrize("rule", ["trimmed_mean", "median"])
def test_the_first_pass_takes_a_trimmed_rule_with_the_bits_of_its_own_pass(
    n: int, length: int, rule: str
) -> None:
    """With a trim, the same sort gives the rule's mean, distances and drop counts: the
    rule's result from them is its own pass's, bit for bit; the norms and centre are
    unchanged by the wider network."""
    generator = torch.Generator().manual_seed(SEED + n)
    vectors = [torch.randn(length, generator=generator) * (1 + i) for i in range(n)]
    vectors[0][:7] = -0.0
    vectors[-1][100:200] = 0.0
    chosen = make_rule(AggregationSpec(rule=rule))
    assert isinstance(chosen, RankedRule)
    trim = chosen.trim_for(n)
    ahead = measure_with_centre(vectors, trim)
    assert ahead is not None and ahead.mean is not None, "the kernel is installed in the tests"
    plain = measure_with_centre(vectors)
    assert plain is not None
    assert (ahead.norms, ahead.dots, ahead.centre_norm) == (
        plain.norms, plain.dots, plain.centre_norm
    ), f"seed={SEED + n}"  # fmt: skip
    ids = tuple(f"{i:064x}" for i in range(n))
    contributions = [Contribution(i, v) for i, v in zip(ids, vectors, strict=True)]
    own = chosen.aggregate(contributions)
    taken = chosen.from_ranked(
        contributions, (), Ranked(ids, trim, ahead.mean, ahead.distances, ahead.dropped)
    )
    assert taken is not None and own.aggregate is not None and taken.aggregate is not None
    assert torch.equal(taken.aggregate.view(torch.int32), own.aggregate.view(torch.int32))
    assert (taken.diagnostics, taken.reason) == (own.diagnostics, own.reason), f"seed={SEED + n}"
    # another cohort, or another trim, is not this mean
    ranked = Ranked(ids, trim, ahead.mean, ahead.distances, ahead.dropped)
    assert chosen.from_ranked(contributions[1:], (), ranked) is None
    other = Ranked(ids, trim + 1, ahead.mean, ahead.distances, ahead.dropped)
    assert chosen.from_ranked(contributions, (), other) is None


def test_the_first_pass_leaves_a_bad_vector_to_measure() -> None:
    vectors = [torch.ones(70_000), torch.ones(70_000)]
    vectors[1][69_999] = float("nan")
    assert measure_with_centre(vectors) is None
    assert isinstance(measure(vectors)[1], str)


def test_a_centre_computed_ahead_is_used_only_for_the_updates_it_was_made_of() -> None:
    cohort = honest_cohort(6)
    cohort.append(Candidate(f"{6:064x}", {k: v * 50 for k, v in cohort[0].tensors.items()}))
    plain = screen_cohort(cohort, SCHEMA, SPEC)
    assert not verdict_of(plain, f"{6:064x}").accepted  # turned down on its norm
    ids = tuple(c.update_id for c in cohort)
    wrong = Centre(ids, tuple(1.0 for _ in ids), 1.0)  # made of all seven: not used
    assert screen_cohort(cohort, SCHEMA, SPEC, wrong).verdicts == plain.verdicts
    honest = cohort[:6]
    centre = Centre(tuple(c.update_id for c in honest), tuple(-1.0 for _ in honest), 1.0)
    hinted = screen_cohort(honest, SCHEMA, SPEC, centre)  # used: every cosine is negative
    assert not any(v.accepted for v in hinted.verdicts)
