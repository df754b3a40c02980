"""Lease coverage: the counting by hand, against lease_indices, and `experiment coverage`."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from p2ptrain.cli.main import main
from p2ptrain.core.manifests import DatasetManifest, ExperimentManifest, ShardInfo
from p2ptrain.data.shards import lease_indices
from p2ptrain.errors import LocalError
from p2ptrain.protocol.coverage import lease_counts, lease_coverage, summarise_counts
from p2ptrain.protocol.leases import Lease, lease_for
from tests.support.builders import experiment, h, identity

ROOT = Path(__file__).resolve().parents[3]
DATASET = DatasetManifest(
    name="d",
    shards=(
        ShardInfo(name="a", blob_id=h("a"), samples=4),
        ShardInfo(name="b", blob_id=h("b"), samples=3),
    ),
)


def lease(*parts: tuple[str, int, int]) -> Lease:
    return Lease(window=1, peer_id="p", parts=parts)


def test_counts_by_hand() -> None:
    # a = indices 0..3, b = 4..6.
    leases = [
        lease(("a", 2, 3)),  # 2, 3, then wraps to 0
        lease(("b", 1, 2), ("a", 0, 4)),  # 5, 6; 0, 1, 2, 3
        lease(("b", 2, 3)),  # 6, then 4, 5
    ]
    counts = lease_counts(DATASET, leases)
    assert counts.tolist() == [2, 1, 2, 2, 1, 2, 2]
    figures = summarise_counts(counts, trainers=3, windows=1, shards=2, lease_size=3)
    assert figures.samples == 7
    assert figures.leases == 3
    assert figures.coverage == 1.0
    assert figures.never_leased == 0
    assert figures.mean_leases_per_sample == 12 / 7
    assert figures.max_leases == 2
    assert figures.max_over_mean == pytest.approx(2 / (12 / 7))


def test_samples_never_leased_are_counted() -> None:
    counts = lease_counts(DATASET, [lease(("a", 3, 2))])  # 3, 0
    assert counts.tolist() == [1, 0, 0, 1, 0, 0, 0]
    figures = summarise_counts(counts, trainers=1, windows=1, shards=2, lease_size=2)
    assert figures.coverage == 2 / 7
    assert figures.never_leased == 5
    assert figures.mean_leases_per_sample == 2 / 7
    assert figures.max_over_mean == 3.5


def test_nothing_leased_gives_zeros() -> None:
    figures = summarise_counts(lease_counts(DATASET, []), trainers=0, windows=0, shards=2,
                               lease_size=1)  # fmt: skip
    assert (figures.coverage, figures.never_leased, figures.max_over_mean) == (0.0, 7, 0.0)


def test_a_lease_of_another_dataset_is_refused() -> None:
    with pytest.raises(LocalError, match="'z'"):
        lease_counts(DATASET, [lease(("z", 0, 1))])
    with pytest.raises(LocalError, match="holds 3"):
        lease_counts(DATASET, [lease(("b", 3, 1))])


def test_lease_coverage_counts_what_lease_indices_name() -> None:
    shards = tuple(
        ShardInfo(name=f"s-{i}", blob_id=h(f"s-{i}"), samples=size)
        for i, size in enumerate([9, 30, 4, 17])
    )
    manifest = msgspec.structs.replace(
        experiment([identity(0)], quorum=1),
        dataset=DatasetManifest(name="uneven", shards=shards),
        lease_size=12,
    )
    peers = [identity(50 + i).peer_id for i in range(5)]
    figures = lease_coverage(manifest, peers, range(1, 8))
    counted: Counter[int] = Counter()
    for window in range(1, 8):
        for peer in peers:
            counted.update(lease_indices(manifest.dataset, lease_for(manifest, window, peer)))
    assert (figures.trainers, figures.windows, figures.leases) == (5, 7, 35)
    assert (figures.shards, figures.samples, figures.lease_size) == (4, 60, 12)
    assert figures.never_leased == 60 - len(counted)
    assert figures.coverage == len(counted) / 60
    assert figures.mean_leases_per_sample == 35 * 12 / 60
    assert figures.max_leases == max(counted.values())


def coverage_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["experiment", "coverage", *args, "--json"]) == 0
    figures: dict[str, object] = json.loads(capsys.readouterr().out)
    return figures


ISSUE = ["--shards", "268", "--samples-per-shard", "256", "--lease-size", "80", "--trainers", "8"]


@pytest.mark.parametrize(
    ("windows", "least_coverage", "most_over_mean"), [(200, 0.83, 6.0), (600, 0.99, 3.2)]
)
def test_the_command_reaches_the_figures_of_independent_random_leases(
    capsys: pytest.CaptureFixture[str], windows: int, least_coverage: float, most_over_mean: float
) -> None:
    """268 shards of 256 samples, leases of 80, 8 trainers: random leases reach ~0.845 of the
    samples in 200 windows and ~0.996 in 600, the most-leased sample at ~5 and ~2.9 times
    the mean (10 leases against a mean of 1.87 after 200 windows: the maximum of 68,608
    counts swings by a lease from one experiment id to the next, so the bound allows 11)."""
    figures = coverage_json(capsys, *ISSUE, "--windows", str(windows))
    print(figures)
    assert figures["seed"] == 0
    assert (figures["trainers"], figures["windows"]) == (8, windows)
    assert (figures["shards"], figures["samples"], figures["lease_size"]) == (268, 68608, 80)
    assert figures["mean_leases_per_sample"] == pytest.approx(8 * windows * 80 / 68608)
    assert isinstance(figures["coverage"], float)
    assert isinstance(figures["max_over_mean"], float)
    assert figures["coverage"] >= least_coverage
    assert figures["max_over_mean"] <= most_over_mean


def test_the_seed_draws_other_trainers(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--shards", "10", "--samples-per-shard", "50", "--lease-size", "20"]
    first = coverage_json(capsys, *small, "--trainers", "3", "--windows", "4", "--seed", "1")
    again = coverage_json(capsys, *small, "--trainers", "3", "--windows", "4", "--seed", "1")
    other = coverage_json(capsys, *small, "--trainers", "3", "--windows", "4", "--seed", "2")
    assert first == again
    assert (first["seed"], other["seed"]) == (1, 2)
    del first["seed"], other["seed"]
    assert first != other


def test_the_command_reads_an_experiment_definition(capsys: pytest.CaptureFixture[str]) -> None:
    toml = str(ROOT / "examples" / "experiment.toml")  # two shards of 4096, leases of 512
    args = ["experiment", "coverage", "--experiment-toml", toml, "--trainers", "4"]
    assert main([*args, "--windows", "3"]) == 0
    text = capsys.readouterr().out
    assert "4 trainers x 3 windows (seed 0): 12 leases of 512 samples over 2 shards" in text
    assert "8192 samples" in text
    assert "coverage 0." in text and "max/mean" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shards", "4", "--samples-per-shard", "5"], "--lease-size: missing"),
        (["--lease-size", "3"], "--shards, --samples-per-shard: missing"),
        (["--shards", "4", "--samples-per-shard", "5", "--lease-size", "21"], "use 1 to 20"),
        (["--shards", "0", "--samples-per-shard", "5", "--lease-size", "1"], "--shards 0"),
        (["--shards", "2", "--samples-per-shard", "0", "--lease-size", "1"], "--samples-per"),
        (["--experiment-toml", "x.toml", "--shards", "3"], "--shards: not with"),
        (["--experiment-toml", "/nonexistent/x.toml"], "cannot read the experiment"),
    ],
)
def test_bad_options_exit_2_saying_which_and_what_to_do(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code = main(["experiment", "coverage", *args, "--trainers", "2", "--windows", "2"])
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--trainers", "--windows"])
def test_a_count_below_one_is_refused(capsys: pytest.CaptureFixture[str], option: str) -> None:
    base = {"--trainers": "2", "--windows": "2", option: "0"}
    shape = ["--shards", "2", "--samples-per-shard", "3", "--lease-size", "2"]
    code = main(["experiment", "coverage", *shape, *(x for kv in base.items() for x in kv)])
    assert code == 2
    assert f"{option} 0: use 1 or more" in capsys.readouterr().err


def test_the_manifest_used_is_a_valid_experiment() -> None:
    from p2ptrain.cli.experiment_commands import _coverage_manifest

    manifest = _coverage_manifest(DATASET, 3, seed=5)
    assert isinstance(manifest, ExperimentManifest)
    assert manifest.lease_size == 3
    assert manifest.dataset == DATASET
    assert _coverage_manifest(DATASET, 3, seed=6).id != manifest.id
