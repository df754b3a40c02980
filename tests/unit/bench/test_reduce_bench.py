"""``p2ptrain bench reduce`` on a tiny model: the cohort is prepared in one process and
reduced in another, every update is accepted, and the figures agree with each other."""

from __future__ import annotations

import json

import pytest

from p2ptrain.bench.reduce import ReduceBenchConfig, _shapes
from p2ptrain.cli.main import main
from p2ptrain.errors import LocalError


def test_the_synthetic_model_has_exactly_the_parameters_asked_for() -> None:
    for params in (1, 1023, 1024, 5 * 1024 + 7, 4096 * 1024 * 2 + 3):
        shapes = _shapes(params)
        total = 0
        for shape in shapes.values():
            count = 1
            for size in shape:
                count *= size
            assert count <= 4096 * 1024
            total += count
        assert total == params


def test_a_bad_setting_is_refused_naming_the_option() -> None:
    with pytest.raises(LocalError, match="--updates 0"):
        ReduceBenchConfig(params=10, updates=0)
    with pytest.raises(LocalError, match="--codec 'nope'"):
        ReduceBenchConfig(params=10, updates=2, codec="nope")
    with pytest.raises(LocalError, match="--rule 'nope'"):
        ReduceBenchConfig(params=10, updates=2, rule="nope")


def test_one_reduction_is_measured_against_a_plain_read_of_its_bytes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["bench", "reduce", "--params", "60000", "--updates", "3", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["accepted"], result["rejected"]) == (3, 0)
    assert len(result["head_id"]) == 64
    assert result["model_fp32_mib"] == round(60000 * 4 / (1 << 20), 1)
    assert result["reduction_seconds"] > 0 and result["floor_seconds"] > 0
    assert result["ratio_to_floor"] == pytest.approx(
        result["reduction_seconds"] / result["floor_seconds"], rel=0.05
    )
    per = result["reduction_seconds"] * 1000 / 0.06 / 3
    assert result["ms_per_mparam_per_update"] == pytest.approx(per, rel=0.01)
    assert result["peak_rss_mib"] >= result["rss_after_imports_mib"]
    assert result["growth_budget_mib"] == pytest.approx(3 * result["model_fp32_mib"] + 256, 0.01)
