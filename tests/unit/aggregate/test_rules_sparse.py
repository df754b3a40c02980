"""``contributor_mean``: each coordinate averaged over the updates that sent it, after each
update is clipped to the cohort's median norm; hand-computed values, order invariance, its
diagnostics and its configuration."""

from __future__ import annotations

import random

import pytest
import torch

from p2ptrain.aggregate.cohort import CLIPPED, SELECTED, Contribution
from p2ptrain.aggregate.rules import make_rule
from p2ptrain.aggregate.rules_basic import float32
from p2ptrain.core.manifests import AggregationSpec
from p2ptrain.errors import LocalError

SEED = 20261206


def cohort(*rows: list[float]) -> list[Contribution]:
    return [Contribution(f"u{i}", torch.tensor(row)) for i, row in enumerate(rows)]


def test_each_coordinate_is_averaged_over_its_senders() -> None:
    result = make_rule(AggregationSpec(rule="contributor_mean", config={"clip": 0})).aggregate(
        cohort([2.0, 0.0, 4.0, 0.0], [0.0, 0.0, 2.0, 1.0], [4.0, 0.0, 0.0, 0.0])
    )
    assert result.aggregate is not None
    # a mean over all three would give [2, 0, 2, 1/3]
    assert result.aggregate.tolist() == [3.0, 0.0, 3.0, 1.0]
    assert [d.status for d in result.diagnostics] == [SELECTED] * 3


def test_an_update_larger_than_the_median_norm_is_clipped_to_it() -> None:
    # norms 5, 1 and 2: the median is 2, so the first is scaled by 2 / 5
    rows = ([3.0, 4.0, 0.0], [0.0, 0.0, 1.0], [0.0, 2.0, 0.0])
    result = make_rule(AggregationSpec(rule="contributor_mean")).aggregate(cohort(*rows))
    assert result.aggregate is not None
    c = float32(2 / 5)
    first = torch.tensor(rows[0]) * c
    expected = [float(first[0]), float((first[1] + torch.tensor(2.0)) / 2), 1.0]
    assert result.aggregate.tolist() == expected
    assert [d.status for d in result.diagnostics] == [CLIPPED, SELECTED, SELECTED]
    assert "0.4" in result.diagnostics[0].detail
    assert "1 clipped to the median norm" in result.reason


def test_the_order_of_the_cohort_changes_no_bit() -> None:
    generator = torch.Generator().manual_seed(SEED)
    rows = []
    for _ in range(7):
        row = torch.randn(5000, generator=generator)
        row[torch.rand(5000, generator=generator) > 0.05] = 0.0  # about 5% sent
        rows.append(row * float(torch.rand(1, generator=generator) * 4))
    contributions = [Contribution(f"u{i}", row) for i, row in enumerate(rows)]
    first = make_rule(AggregationSpec(rule="contributor_mean")).aggregate(contributions)
    shuffled = list(contributions)
    random.Random(SEED).shuffle(shuffled)
    again = make_rule(AggregationSpec(rule="contributor_mean")).aggregate(shuffled)
    assert first.aggregate is not None and again.aggregate is not None
    assert torch.equal(first.aggregate.view(torch.int32), again.aggregate.view(torch.int32))
    assert first.diagnostics == again.diagnostics
    # nothing anybody sent is lost, and nothing nobody sent appears
    sent = torch.stack(rows).ne(0).any(dim=0)
    assert torch.equal(first.aggregate.ne(0), sent)


def test_an_empty_cohort_gives_no_aggregate() -> None:
    result = make_rule(AggregationSpec(rule="contributor_mean")).aggregate([])
    assert result.aggregate is None
    assert "no contributions" in result.reason


@pytest.mark.parametrize("config", [{"clip": 2}, {"clip": True}, {"tau": 1}])
def test_bad_settings_name_their_key(config: dict[str, int]) -> None:
    with pytest.raises(LocalError, match=f"aggregation.config.{next(iter(config))}"):
        make_rule(AggregationSpec(rule="contributor_mean", config=dict(config)))
