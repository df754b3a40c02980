"""The Byzantine benchmark harness: it can see a rule fail, and the default pipeline hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2ptrain.bench.byzantine import (
    ByzantineConfig,
    run_byzantine_benchmark,
    train_run,
    write_heatmap,
)
from p2ptrain.core.manifests import AggregationSpec, ScreeningSpec
from p2ptrain.data.digits import load_digits_split

SEED = 3
CONFIG = ByzantineConfig(rounds=12, seed=SEED)


@pytest.fixture(scope="module")
def digits():  # type: ignore[no-untyped-def]
    return load_digits_split(CONFIG.workers, SEED)


def test_honest_training_learns(digits) -> None:  # type: ignore[no-untyped-def]
    accuracy = train_run(digits, CONFIG, AggregationSpec(rule="mean"), "none", 0)
    assert accuracy > 0.85, f"seed={SEED}"


def test_the_harness_sees_plain_mean_fail(digits) -> None:  # type: ignore[no-untyped-def]
    honest = train_run(digits, CONFIG, AggregationSpec(rule="mean"), "none", 0)
    attacked = train_run(digits, CONFIG, AggregationSpec(rule="mean"), "gaussian", 3)
    assert attacked < honest - 0.3, f"seed={SEED}: {attacked} vs {honest}"


def test_the_default_pipeline_holds_under_the_same_attack(digits) -> None:  # type: ignore[no-untyped-def]
    honest = train_run(digits, CONFIG, AggregationSpec(rule="mean"), "none", 0)
    defended = train_run(
        digits, CONFIG, AggregationSpec(), "gaussian", 3, screening=ScreeningSpec()
    )
    assert defended > honest - 0.05, f"seed={SEED}: {defended} vs {honest}"


def test_report_shape_and_heatmap(tmp_path: Path) -> None:
    config = ByzantineConfig(
        rounds=2, seed=SEED, byzantine=(3,), attacks=("sign_flip",), rules=("mean", "median")
    )
    report = run_byzantine_benchmark(config)
    assert report["default_rule"] == "trimmed_mean"
    assert {"rule", "attack", "byzantine", "screened", "accuracy"} <= set(report["results"][0])
    # each rule alone and behind screening: honest (f=0) and the one attack (f=3)
    assert len(report["results"]) == 2 * 2 * 2
    assert [r["attack"] for r in report["default_rule_results"]] == ["sign_flip"]
    path = tmp_path / "heatmap.png"
    write_heatmap(report, path, config.byzantine)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
