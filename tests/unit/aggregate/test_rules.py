"""Aggregation rules against hand-computed values, their diagnostics and configuration, and
hypothesis properties (identical updates, order invariance, Krum against far outliers)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.aggregate import rules_basic
from p2ptrain.aggregate.cohort import (
    CLIPPED,
    EXCLUDED,
    FAILED,
    SELECTED,
    TRIMMED,
    AggregationResult,
    Contribution,
    Failure,
)
from p2ptrain.aggregate.exact import CHUNK
from p2ptrain.aggregate.rules import (
    CenteredClip,
    CenteredClipConfig,
    GeometricMedian,
    GeometricMedianConfig,
    Krum,
    KrumConfig,
    Mean,
    Median,
    StreamingRule,
    TrimmedMean,
    TrimmedMeanConfig,
    make_rule,
    rule_names,
)
from p2ptrain.aggregate.rules_basic import sorting_network
from p2ptrain.core.manifests import AGGREGATION_RULES, AggregationSpec
from p2ptrain.errors import LocalError

# Five updates of three values (ids a..e), the last two outliers.
COHORT = {
    "a": [1.0, 2.0, 3.0],
    "b": [2.0, 3.0, 4.0],
    "c": [3.0, 4.0, 5.0],
    "d": [4.0, 5.0, 60.0],
    "e": [100.0, -100.0, 0.0],
}


def cohort(
    values: dict[str, list[float]] = COHORT, weights: dict[str, float] | None = None
) -> list[Contribution]:
    weights = weights or {}
    return [
        Contribution(uid, torch.tensor(v, dtype=torch.float32), weights.get(uid, 1.0))
        for uid, v in values.items()
    ]


def distance(a: list[float], b: list[float]) -> float:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))


def assert_result(
    result: AggregationResult,
    aggregate: list[float],
    statuses: dict[str, str],
    values: dict[str, list[float]] = COHORT,
) -> None:
    assert result.aggregate is not None, result.reason
    assert result.aggregate.tolist() == aggregate, result.reason
    assert [d.update_id for d in result.diagnostics] == sorted(statuses)
    for d in result.diagnostics:
        assert d.status == statuses[d.update_id], d
        if d.status != FAILED:
            assert d.distance == distance(values[d.update_id], aggregate), d


# --- hand-computed values -------------------------------------------------------------------


def test_mean_weights_by_lease_samples() -> None:
    # Weights 1,1,1,1,4: coefficients 1/8 x4 and 1/2, all exact in binary.
    result = Mean().aggregate(cohort(weights={"e": 4.0}))
    assert_result(result, [51.25, -48.25, 9.0], dict.fromkeys(COHORT, SELECTED))
    assert result.diagnostics[0].detail == "weight share 0.125"
    assert result.diagnostics[4].detail == "weight share 0.5"
    assert result.reason == "mean: weighted mean of 5 updates"


def test_trimmed_mean_drops_one_value_per_side_and_reports_what_it_dropped() -> None:
    # beta 0.2 of 5 updates: one per side. Column 0: 1 2 3 4 100 -> (2 + 3 + 4) / 3 = 3;
    # column 1: -100 2 3 4 5 -> 3; column 2: 0 3 4 5 60 -> 4.
    result = TrimmedMean(TrimmedMeanConfig(beta=0.2)).aggregate(cohort())
    assert_result(result, [3.0, 3.0, 4.0], dict.fromkeys(COHORT, TRIMMED))
    details = {d.update_id: d.detail for d in result.diagnostics}
    assert details == {
        "a": "dropped 0.333333 of coordinates (1)",
        "b": "dropped 0 of coordinates (0)",
        "c": "dropped 0 of coordinates (0)",
        "d": "dropped 0.666667 of coordinates (2)",
        "e": "dropped 1 of coordinates (3)",
    }
    assert "dropped 1 of 5 values per side" in result.reason


def test_trimmed_mean_ties_at_the_boundary_count_as_kept() -> None:
    # 1 1 1 5 9: drop one 1 and the 9, mean of 1 1 5 = 7 / 3 (float32 division).
    values = {"a": [1.0], "b": [1.0], "c": [9.0], "d": [1.0], "e": [5.0]}
    result = TrimmedMean().aggregate(cohort(values))
    assert result.aggregate is not None
    assert result.aggregate.tolist() == [torch.tensor(7.0 / 3.0).item()]
    dropped = {d.update_id: d.detail.endswith("(1)") for d in result.diagnostics}
    assert dropped == {"a": False, "b": False, "c": True, "d": False, "e": False}


def test_trimmed_mean_with_beta_zero_is_the_plain_mean_and_trims_nothing() -> None:
    values = {"a": [1.0, -2.0], "b": [3.0, 4.0], "c": [5.0, 7.0], "d": [7.0, -1.0]}
    result = TrimmedMean(TrimmedMeanConfig(beta=0.0)).aggregate(cohort(values))
    assert_result(result, [4.0, 2.0], dict.fromkeys(values, TRIMMED), values)
    assert all(d.detail == "dropped 0 of coordinates (0)" for d in result.diagnostics)


def test_median_of_an_odd_cohort() -> None:
    result = Median().aggregate(cohort())
    assert_result(result, [3.0, 3.0, 4.0], dict.fromkeys(COHORT, TRIMMED))
    details = {d.update_id: d.detail for d in result.diagnostics}
    assert details["a"] == "dropped 1 of coordinates (3)"  # 1 2 3 against 3 3 4
    assert details["b"] == "dropped 0.333333 of coordinates (1)"  # only 2 < 3
    assert details["c"] == "dropped 0.666667 of coordinates (2)"  # 4 > 3 and 5 > 4


def test_median_of_an_even_cohort_is_the_midpoint() -> None:
    values = {k: COHORT[k] for k in "abcd"}
    # Column 0: 1 2 3 4 -> 2.5; column 1: 2 3 4 5 -> 3.5; column 2: 3 4 5 60 -> 4.5.
    result = Median().aggregate(cohort(values))
    assert_result(result, [2.5, 3.5, 4.5], dict.fromkeys(values, TRIMMED), values)


def test_median_turns_negative_zero_into_positive_zero() -> None:
    values = {"a": [-0.0], "b": [-0.0], "c": [0.0]}
    result = Median().aggregate(cohort(values))
    assert result.aggregate is not None
    assert not bool(torch.signbit(result.aggregate).any())


def test_krum_keeps_the_best_scores_and_breaks_ties_by_update_id() -> None:
    # Squared distances: ab 3, ac 12, bc 3, ad 3267, bd 3144, cd 3027, e >= 20214.
    # f = 1 -> 2 nearest: a 3+12=15, b 3+3=6, c 3+12=15, d 3027+3144=6171, e 20214+20229.
    # m = 2: b, then a (ties with c, smaller id). Weights 1 and 3 -> 1/4 and 3/4.
    result = Krum(KrumConfig(f=1, m=2)).aggregate(cohort(weights={"a": 1.0, "b": 3.0}))
    expected = [0.25 * 1 + 0.75 * 2, 0.25 * 2 + 0.75 * 3, 0.25 * 3 + 0.75 * 4]
    statuses = {"a": SELECTED, "b": SELECTED, "c": EXCLUDED, "d": EXCLUDED, "e": EXCLUDED}
    assert_result(result, expected, statuses)
    details = {d.update_id: d.detail for d in result.diagnostics}
    assert details["b"] == "score 6, rank 1 of 5"
    assert details["a"] == "score 15, rank 2 of 5"
    assert details["c"] == "score 15, rank 3 of 5"
    assert details["e"] == "score 40443, rank 5 of 5"


def test_krum_defaults_to_the_largest_f_and_m_is_n_minus_f() -> None:
    result = Krum().aggregate(cohort())  # n = 5 -> f = 1, m = 4: e is left out
    statuses = {d.update_id: d.status for d in result.diagnostics}
    assert statuses == {"a": SELECTED, "b": SELECTED, "c": SELECTED, "d": SELECTED, "e": EXCLUDED}
    assert result.reason == "krum: averaged the 4 best-scored of 5 updates (f=1)"


@pytest.mark.parametrize(
    ("config", "count", "reason"),
    [
        (KrumConfig(f=1), 4, "krum: needs at least 5 updates (n >= 2f + 3), got 4"),
        (KrumConfig(), 2, "krum: needs at least 3 updates (n >= 2f + 3), got 2"),
        (KrumConfig(), 0, "krum: needs at least 3 updates (n >= 2f + 3), got 0"),
    ],
)
def test_krum_with_too_few_updates_gives_no_aggregate(
    config: KrumConfig, count: int, reason: str
) -> None:
    values = dict(list(COHORT.items())[:count])
    result = Krum(config).aggregate(cohort(values), [Failure("z", "late")])
    assert result.aggregate is None
    assert result.reason == reason
    assert [(d.update_id, d.status) for d in result.diagnostics] == [
        *((uid, EXCLUDED) for uid in values),
        ("z", FAILED),
    ]


# u1 = 0, u2 = (3, 4, 0) at distance 5, u3 = (0, 0, 10) at distance 10 from the median 0.
CLIP_COHORT = {"u1": [0.0, 0.0, 0.0], "u2": [3.0, 4.0, 0.0], "u3": [0.0, 0.0, 10.0]}


def test_centered_clip_with_a_fixed_tau() -> None:
    # Weights 2, 1, 1 -> 1/2, 1/4, 1/4; tau 2.5 -> scales 1, 1/2, 1/4;
    # v = 0 + 1/8 (3, 4, 0) + 1/16 (0, 0, 10) = (0.375, 0.5, 0.625).
    rule = CenteredClip(CenteredClipConfig(tau=2.5, iterations=1))
    result = rule.aggregate(cohort(CLIP_COHORT, weights={"u1": 2.0}))
    statuses = {"u1": SELECTED, "u2": CLIPPED, "u3": CLIPPED}
    assert_result(result, [0.375, 0.5, 0.625], statuses, CLIP_COHORT)
    assert [d.detail for d in result.diagnostics] == ["not clipped", "scale 0.5", "scale 0.25"]


def test_centered_clip_picks_the_median_distance_as_tau() -> None:
    # Distances 0, 5, 10 -> tau 5: only u3 is clipped (scale 1/2);
    # v = 1/4 (3, 4, 0) + 1/8 (0, 0, 10) = (0.75, 1, 1.25).
    rule = CenteredClip(CenteredClipConfig(iterations=1))
    result = rule.aggregate(cohort(CLIP_COHORT, weights={"u1": 2.0}))
    statuses = {"u1": SELECTED, "u2": SELECTED, "u3": CLIPPED}
    assert_result(result, [0.75, 1.0, 1.25], statuses, CLIP_COHORT)
    assert "tau 5 (automatic)" in result.reason


# Median (0, 0, 0); distances 4, 3, 12 -> beta 1/4, 1/3, 1/12 -> shares 3/8, 1/2, 1/8.
WEISZFELD_COHORT = {"p": [0.0, 4.0, 0.0], "q": [3.0, 0.0, 0.0], "r": [0.0, 0.0, 12.0]}


def test_geometric_median_takes_one_weiszfeld_step() -> None:
    rule = GeometricMedian(GeometricMedianConfig(iterations=1))
    result = rule.aggregate(cohort(WEISZFELD_COHORT))
    assert_result(result, [1.5, 1.5, 1.5], dict.fromkeys("pqr", SELECTED), WEISZFELD_COHORT)
    assert [d.detail for d in result.diagnostics] == [
        "weight share 0.375",
        "weight share 0.5",
        "weight share 0.125",
    ]
    assert result.reason.startswith("geometric_median: stopped after 1 Weiszfeld steps")


def test_geometric_median_stops_when_the_step_is_small_relative_to_the_estimate() -> None:
    # Step 1 moves away from 0, whose norm is 0: not converged. Step 2 moves by less than
    # 10 times the norm of step 1's estimate: converged.
    rule = GeometricMedian(GeometricMedianConfig(iterations=50, tolerance=10.0))
    result = rule.aggregate(cohort(WEISZFELD_COHORT))
    assert result.reason.startswith("geometric_median: converged after 2 Weiszfeld steps")


def test_geometric_median_of_identical_updates_converges_on_them() -> None:
    values = {k: [1.5, -2.0, 0.25] for k in "abc"}
    result = GeometricMedian().aggregate(cohort(values))
    assert result.aggregate is not None
    assert result.aggregate.tolist() == [1.5, -2.0, 0.25]
    assert "converged after 1 " in result.reason


# --- contract: failures, empty cohorts, out=, misuse ------------------------------------------


@pytest.mark.parametrize("name", rule_names())
def test_failures_come_back_as_failed_diagnostics_in_id_order(name: str) -> None:
    rule = make_rule(AggregationSpec(rule=name))
    failures = [Failure("bb", "bad signature"), Failure("0", "undecodable")]
    result = rule.aggregate(cohort(), failures)
    assert result.ok, result.reason
    assert [d.update_id for d in result.diagnostics] == ["0", "a", "b", "bb", "c", "d", "e"]
    failed = [(d.update_id, d.distance, d.detail) for d in result.diagnostics if d.status == FAILED]
    assert failed == [("0", None, "undecodable"), ("bb", None, "bad signature")]


@pytest.mark.parametrize("name", rule_names())
def test_an_empty_cohort_gives_no_aggregate_and_a_reason(name: str) -> None:
    result = make_rule(AggregationSpec(rule=name)).aggregate([], [Failure("x", "late")])
    assert result.aggregate is None
    assert result.reason.startswith(name)
    assert [(d.update_id, d.status) for d in result.diagnostics] == [("x", FAILED)]


@pytest.mark.parametrize("name", rule_names())
def test_out_receives_the_aggregate(name: str) -> None:
    rule = make_rule(AggregationSpec(rule=name))
    expected = rule.aggregate(cohort()).aggregate
    out = torch.full((3,), float("nan"))
    result = rule.aggregate(cohort(), out=out)
    assert result.aggregate is out
    assert expected is not None and torch.equal(out, expected)


def test_a_wrong_out_buffer_is_refused() -> None:
    with pytest.raises(LocalError, match="out must be a contiguous 1-D float32 tensor of 3"):
        Mean().aggregate(cohort(), out=torch.zeros(4))
    with pytest.raises(LocalError, match="float32"):
        Mean().aggregate(cohort(), out=torch.zeros(3, dtype=torch.float64))
    contributions = cohort()
    with pytest.raises(LocalError, match="shares memory with a contribution"):
        Mean().aggregate(contributions, out=contributions[2].vector)


def test_an_update_that_is_both_contribution_and_failure_is_misuse() -> None:
    with pytest.raises(LocalError, match="appears twice"):
        Mean().aggregate(cohort(), [Failure("c", "late")])
    with pytest.raises(LocalError, match="appears twice"):
        Mean().aggregate(cohort(), [Failure("x", "late"), Failure("x", "again")])


@pytest.mark.parametrize("name", rule_names())
def test_rules_accept_empty_vectors(name: str) -> None:
    contributions = [Contribution(uid, torch.zeros(0)) for uid in "abcde"]
    result = make_rule(AggregationSpec(rule=name)).aggregate(contributions)
    assert result.aggregate is not None and result.aggregate.numel() == 0
    assert all(d.distance == 0.0 for d in result.diagnostics)


# --- configuration and registry ---------------------------------------------------------------


def test_the_registry_covers_every_manifest_rule() -> None:
    assert set(rule_names()) == set(AGGREGATION_RULES)
    for name in AGGREGATION_RULES:
        assert make_rule(AggregationSpec(rule=name)).name == name


@pytest.mark.parametrize(
    ("rule", "config", "key"),
    [
        ("trimmed_mean", {"beta": 0.5}, "beta"),
        ("trimmed_mean", {"beta": -0.1}, "beta"),
        ("trimmed_mean", {"beta": "0.2"}, "beta"),
        ("trimmed_mean", {"beta": True}, "beta"),
        ("krum", {"f": -1}, "f"),
        ("krum", {"f": 1.5}, "f"),
        ("krum", {"m": 0}, "m"),
        ("centered_clip", {"tau": 0.0}, "tau"),
        ("centered_clip", {"iterations": 0}, "iterations"),
        ("geometric_median", {"eps": 0.0}, "eps"),
        ("geometric_median", {"tolerance": -1.0}, "tolerance"),
        ("geometric_median", {"iterations": 1001}, "iterations"),
    ],
)
def test_bad_settings_name_their_key(rule: str, config: dict[str, object], key: str) -> None:
    spec = AggregationSpec(rule=rule, config=config)  # type: ignore[arg-type]
    with pytest.raises(LocalError, match=rf"aggregation\.config\.{key} must be"):
        make_rule(spec)


def test_an_unknown_setting_is_named_with_the_known_ones() -> None:
    with pytest.raises(
        LocalError, match=r"aggregation\.config\.betta .*\(its settings are: beta\)"
    ):
        make_rule(AggregationSpec(rule="trimmed_mean", config={"betta": 0.1}))
    with pytest.raises(LocalError, match=r"aggregation\.config\.beta .*\(it takes none\)"):
        make_rule(AggregationSpec(rule="mean", config={"beta": 0.1}))


def test_settings_from_the_manifest_reach_the_rule() -> None:
    spec = AggregationSpec(rule="krum", config={"f": 2, "m": 3})
    rule = make_rule(spec)
    assert isinstance(rule, Krum) and rule.config == KrumConfig(f=2, m=3)


# --- sorting ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 11))
def test_the_sorting_network_sorts_every_zero_one_input(n: int) -> None:
    """By the 0-1 principle a comparator network that sorts all 2**n zero-one inputs sorts
    everything; the pruned networks must still place the kept ranks."""
    for low, high in {(0, n - 1), ((n - 1) // 2, n // 2), (min(1, n - 1), max(n - 2, 0))}:
        network = sorting_network(n, low, high)
        for bits in itertools.product((0, 1), repeat=n):
            wires = list(bits)
            for a, b in network:
                wires[a], wires[b] = min(wires[a], wires[b]), max(wires[a], wires[b])
            assert wires[low : high + 1] == sorted(bits)[low : high + 1], (n, low, high, bits)


@pytest.mark.parametrize("n", [3, 8, 9])
def test_network_and_torch_sort_give_the_same_bits(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    seed = 1000 + n
    generator = torch.Generator().manual_seed(seed)
    values = {f"{i:02d}": torch.randn(CHUNK + 9, generator=generator).tolist() for i in range(n)}
    with_network = TrimmedMean(TrimmedMeanConfig(beta=0.25)).aggregate(cohort(values))
    monkeypatch.setattr(rules_basic, "NETWORK_MAX_UPDATES", 0)
    with_sort = TrimmedMean(TrimmedMeanConfig(beta=0.25)).aggregate(cohort(values))
    assert with_network.aggregate is not None and with_sort.aggregate is not None
    assert torch.equal(with_network.aggregate, with_sort.aggregate), f"seed={seed}"
    assert with_network.diagnostics == with_sort.diagnostics, f"seed={seed}"


# --- properties -------------------------------------------------------------------------------

seeds = st.integers(0, 2**32 - 1)


def random_vectors(seed: int, n: int, length: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    vectors = [torch.randn(length, generator=generator) * 10 for _ in range(n)]
    for vector in vectors[1::2]:  # some exact ties and signed zeros
        vector[: length // 3] = vectors[0][: length // 3]
        vector[length // 3 : length // 2] = -0.0
    return vectors


def ids(n: int) -> list[str]:
    return [f"update-{i:03d}" for i in range(n)]


@settings(max_examples=200, deadline=None)
@given(
    seed=seeds, n=st.integers(1, 9), length=st.integers(1, 40), name=st.sampled_from(rule_names())
)
def test_identical_updates_aggregate_to_that_update(
    seed: int, n: int, length: int, name: str
) -> None:
    vector = random_vectors(seed, 1, length)[0]
    contributions = [Contribution(uid, vector.clone(), 1.0 + i) for i, uid in enumerate(ids(n))]
    rule: StreamingRule = make_rule(AggregationSpec(rule=name))
    result = rule.aggregate(contributions)
    if name == "krum" and n < 3:
        assert result.aggregate is None, f"seed={seed}"
        return
    assert result.aggregate is not None, f"seed={seed} {result.reason}"
    assert torch.allclose(result.aggregate, vector, rtol=1e-6, atol=0.0), f"seed={seed}"
    if name == "median":
        assert torch.equal(result.aggregate, vector), f"seed={seed}"


@settings(max_examples=200, deadline=None)
@given(
    seed=seeds,
    n=st.integers(1, 9),
    length=st.integers(1, 40),
    name=st.sampled_from(["trimmed_mean", "median"]),
)
def test_coordinate_rules_do_not_depend_on_which_update_holds_which_values(
    seed: int, n: int, length: int, name: str
) -> None:
    """Stronger than ignoring the input order: the values may move between update ids."""
    vectors = random_vectors(seed, n, length)
    shuffled = list(vectors)
    random.Random(seed).shuffle(shuffled)
    rule = make_rule(AggregationSpec(rule=name))
    first = rule.aggregate([Contribution(u, v) for u, v in zip(ids(n), vectors, strict=True)])
    second = rule.aggregate([Contribution(u, v) for u, v in zip(ids(n), shuffled, strict=True)])
    assert first.aggregate is not None and second.aggregate is not None
    a, b = first.aggregate.numpy().tobytes(), second.aggregate.numpy().tobytes()
    assert a == b, f"seed={seed}"


@settings(max_examples=200, deadline=None)
@given(seed=seeds, n=st.integers(1, 9), length=st.integers(1, 40), weight=st.floats(0.5, 100.0))
def test_the_mean_with_equal_weights_is_the_unweighted_mean(
    seed: int, n: int, length: int, weight: float
) -> None:
    vectors = random_vectors(seed, n, length)
    weighted = Mean().aggregate(
        [Contribution(u, v, weight) for u, v in zip(ids(n), vectors, strict=True)]
    )
    unweighted = TrimmedMean(TrimmedMeanConfig(beta=0.0)).aggregate(
        [Contribution(u, v) for u, v in zip(ids(n), vectors, strict=True)]
    )
    assert weighted.aggregate is not None and unweighted.aggregate is not None
    expected = torch.stack(vectors).double().mean(dim=0).float()
    for got in (weighted.aggregate, unweighted.aggregate):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), f"seed={seed}"


@settings(max_examples=200, deadline=None)
@given(seed=seeds, honest=st.integers(3, 9), byzantine=st.integers(0, 3), length=st.integers(1, 30))
def test_krum_never_selects_a_far_byzantine_update(
    seed: int, honest: int, byzantine: int, length: int
) -> None:
    byzantine = min(byzantine, honest - 3)  # Krum needs n = honest + f >= 2 f + 3
    n = honest + byzantine
    generator = torch.Generator().manual_seed(seed)
    centre = torch.randn(length, generator=generator)
    vectors = [centre + 0.01 * torch.randn(length, generator=generator) for _ in range(honest)]
    for _ in range(byzantine):
        vectors.append(centre + 100.0 + torch.randn(length, generator=generator))
    labels = [f"{i:03d}" for i in random.Random(seed).sample(range(1000), n)]
    contributions = [Contribution(u, v) for u, v in zip(labels, vectors, strict=True)]
    result = Krum(KrumConfig(f=byzantine)).aggregate(contributions)
    assert result.aggregate is not None, f"seed={seed}"
    liars = set(labels[honest:n])
    chosen = {d.update_id for d in result.diagnostics if d.status == SELECTED}
    assert chosen and not chosen & liars, f"seed={seed}"
    assert torch.allclose(result.aggregate, centre, atol=0.05), f"seed={seed}"
