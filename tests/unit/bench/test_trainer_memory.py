"""``p2ptrain bench trainer-memory`` at a tiny size: two child processes, one report."""

from __future__ import annotations

import json

import pytest

from p2ptrain.bench.trainer_memory import MAX_RATIO, MemoryBenchConfig, _run_child
from p2ptrain.cli.main import main
from p2ptrain.errors import LocalError

pytest.importorskip("transformers")

TINY = ["--layers", "2", "--width", "32", "--heads", "2", "--block-size", "16"]


def test_the_command_reports_both_peaks_and_their_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["bench", "trainer-memory", *TINY, "--batch-size", "4", "--steps", "2", "--json"]) == 0
    )
    result = json.loads(capsys.readouterr().out)
    # 2 blocks of 12*32*32 + 13*32, 2 layer norms, wte 83*32, wpe 16*32, the final norm
    assert result["parameters"] == 2 * (12 * 32 * 32 + 13 * 32) + 83 * 32 + 16 * 32 + 2 * 32
    assert result["baseline_peak_rss_mib"] > 0
    assert result["trainer_peak_rss_mib"] > 0
    assert result["ratio"] == pytest.approx(
        result["trainer_peak_rss_mib"] / result["baseline_peak_rss_mib"], abs=2e-3
    )
    assert result["max_ratio"] == MAX_RATIO
    assert result["passed"] == (result["ratio"] <= MAX_RATIO)
    assert result["baseline_steps_per_s"] > 0 and result["trainer_steps_per_s"] > 0
    assert result["update_bytes"] > 0
    assert result["config"]["steps"] == 2


def test_a_child_past_its_time_is_killed_and_reported() -> None:
    config = MemoryBenchConfig(n_layer=1, n_embd=8, n_head=2, block_size=4, steps=1)
    with pytest.raises(LocalError, match=r"the trainer measurement took over 0\.2 s"):
        _run_child("trainer", config, timeout_s=0.2)


def test_an_unknown_codec_is_refused_before_any_child_starts() -> None:
    with pytest.raises(LocalError, match="codec must be one of"):
        MemoryBenchConfig(codec="nope")
