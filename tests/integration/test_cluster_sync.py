"""The cluster's gradient-sync figures, two real gloo ranks as two processes: on loopback the
throughputs are positive and finite and the headline ratio is the hook the cluster's
``auto`` chooses for the measured rate; over 100 Mbit/s links in a namespace lab (root only,
skipped otherwise) raw fp32 gloo runs at the link's rate, the cluster chooses PowerSGD,
which beats it more than twice, and the fp16 hook, which sends half the bytes, beats it. A
rank that fails is named, with its log; ranks past the timeout are killed; a shaped run
without namespaces says why."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from p2ptrain.bench import cluster_sync
from p2ptrain.bench.cluster_sync import CLUSTER_HOOKS, sync_figures
from p2ptrain.bench.netns_lab import namespaces_unavailable
from p2ptrain.cluster.settings import choose_compression
from p2ptrain.errors import LocalError

pytestmark = pytest.mark.integration

LINK_MBIT = 100.0


def test_loopback_figures_are_positive_finite_and_name_the_cluster_hook(tmp_path: Path) -> None:
    figures = sync_figures(
        params=200_000, hooks=["fp16"], link_mbit=None, repeats=3, work_dir=tmp_path,
        timeout_s=120,
    )  # fmt: skip

    assert figures["network"] == "loopback" and figures["interfaces"] == ["lo", "lo"]
    assert figures["bytes"] == 4 * 200_000
    gloo = figures["gloo_fp32"]["bytes_per_s"]
    fp16 = figures["hooks"]["fp16"]
    for value in (gloo, fp16["bytes_per_s"], fp16["ratio_to_gloo"]):
        assert math.isfinite(value) and value > 0
    assert fp16["ratio_to_gloo"] == pytest.approx(fp16["bytes_per_s"] / gloo)
    assert fp16["backward_seconds"] > fp16["no_sync_seconds"] > 0
    chosen = CLUSTER_HOOKS[choose_compression(gloo)]
    assert figures["cluster_hook"] == chosen
    assert figures["sync_ratio_to_gloo_loopback"] == figures["hooks"][chosen]["ratio_to_gloo"]
    assert "sync_ratio_to_gloo_shaped" not in figures
    assert (tmp_path / "rank0.log").is_file() and (tmp_path / "rank1.log").is_file()


@pytest.mark.netns
def test_compression_beats_raw_gloo_over_100_mbit_links(tmp_path: Path) -> None:
    reason = namespaces_unavailable(("ip", "tc"))
    if reason is not None:
        pytest.skip(reason)
    figures = sync_figures(
        params=1_000_000, hooks=["fp16"], link_mbit=LINK_MBIT, repeats=3, work_dir=tmp_path,
        timeout_s=120,
    )  # fmt: skip

    assert figures["network"] == "shaped" and "lo" not in figures["interfaces"]
    # Two ranks: each sends and receives the whole fp32 gradient once per all-reduce, so raw
    # gloo moves it at no more than the link's rate (plus the token bucket's burst).
    assert figures["gloo_fp32"]["bytes_per_s"] < 1.2 * LINK_MBIT * 1e6 / 8
    assert figures["cluster_hook"] == "powersgd"
    assert figures["sync_ratio_to_gloo_shaped"] > 2
    assert figures["sync_ratio_to_gloo_shaped"] == figures["hooks"]["powersgd"]["ratio_to_gloo"]
    assert figures["hooks"]["fp16"]["ratio_to_gloo"] > 1.5


def test_a_rank_that_fails_is_named_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(LocalError, match=r"sync rank \d exited with status 1") as caught:
        sync_figures(
            params=1000, hooks=[], link_mbit=None, repeats=1, work_dir=tmp_path,
            python="false", timeout_s=60,
        )  # fmt: skip
    assert str(tmp_path) in str(caught.value)


def test_ranks_that_run_past_the_timeout_are_stopped(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(LocalError, match=r"did not finish within 0\.5 s"):
        sync_figures(
            params=1000, hooks=[], link_mbit=None, repeats=1, work_dir=tmp_path, timeout_s=0.5
        )
    assert time.monotonic() - started < 10  # killed, not waited for


def test_a_shaped_run_without_namespaces_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster_sync, "namespaces_unavailable", lambda tools: "no netns here")
    with pytest.raises(LocalError, match="no netns here"):
        sync_figures(params=1000, hooks=[], link_mbit=LINK_MBIT, repeats=1, work_dir=tmp_path)


def test_an_unknown_hook_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(LocalError, match="unknown hooks zstd"):
        sync_figures(params=1000, hooks=["zstd"], link_mbit=None, repeats=1, work_dir=tmp_path)
    assert not any(tmp_path.iterdir())
