"""``p2ptrain bench data`` on a small dataset: a trainer without data fetches the one shard its
first lease names and starts training; started again on the same directory it fetches
nothing."""

from __future__ import annotations

import pytest

from p2ptrain.bench.data_start import run_data_bench

pytestmark = pytest.mark.integration


def test_a_cold_trainer_fetches_its_leases_shard_and_a_warm_one_nothing() -> None:
    result = run_data_bench(size_mb=4, shard_mb=1)
    cold, warm = result["cold"], result["warm"]
    assert result["shards"] >= 4
    assert cold["shards_fetched"] == 1
    assert 0 < cold["bytes_fetched"] <= result["shard_bytes"]
    assert warm["shards_fetched"] == 0 and warm["bytes_fetched"] == 0
    assert result["ratio"] == round(cold["seconds"] / warm["seconds"], 3)
