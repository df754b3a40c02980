"""``p2ptrain cluster --experiment``: each member is the torchrun agent of its pod rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2ptrain.cli.cluster_pod import PodNetwork, PodTrainerGenerations
from p2ptrain.cli.main import build_parser, main
from p2ptrain.cli.pod_launch import pod_from_environment
from p2ptrain.cluster.membership import GenerationPlan
from p2ptrain.cluster.settings import ClusterSettings
from p2ptrain.errors import LocalError

PLAN = GenerationPlan(
    number=4, leader="aa", members=("aa", "bb", "cc"), since=(0, 2, 4), source_rank=0,
    start_step=0, store_host="10.0.0.1", store_port=29511,
)  # fmt: skip


def _generations(tmp_path: Path, **network: object) -> PodTrainerGenerations:
    settings = ClusterSettings(
        secret=b"s" * 32, data_dir=tmp_path, workload="", experiment="e" * 64, threads=2,
        collective_timeout_s=7.5,
    )  # fmt: skip
    bootstrap = ("127.0.0.1:1", "127.0.0.1:2")
    chosen = PodNetwork(experiment="e" * 64, bootstrap=bootstrap, **network)  # type: ignore[arg-type]
    return PodTrainerGenerations(settings, chosen, "lo", relay=None)


def test_each_rank_is_told_its_place_as_torchrun_would(tmp_path: Path) -> None:
    generations = _generations(tmp_path)
    for rank in range(PLAN.world):
        pod = pod_from_environment(generations.environment(PLAN, rank), timeout_s=7.5)
        assert pod is not None
        assert (pod.rank, pod.world_size, pod.local_rank) == (rank, 3, 0)
        # the generation's number keeps each pod's store keys apart from the last one's
        assert pod.restart == PLAN.number
        assert pod.agent_store == ("10.0.0.1", 29511)
    assert generations.environment(PLAN, 1)["GLOO_SOCKET_IFNAME"] == "lo"


def test_the_ranks_run_p2ptrain_train_with_options_it_takes(tmp_path: Path) -> None:
    secret = tmp_path / "network.secret"
    generations = _generations(tmp_path, secret_file=secret, workload="mine.py:build")
    command = generations.command()
    assert command[1:4] == ["-m", "p2ptrain", "train"]
    args = build_parser(command[3:]).parse_args(command[3:])
    assert args.experiment == "e" * 64
    assert args.bootstrap == ["127.0.0.1:1", "127.0.0.1:2"]
    assert (args.dir, args.secret_file, args.workload) == (
        str(tmp_path / "node"), str(secret), "mine.py:build",
    )  # fmt: skip
    assert (args.threads, args.pod_timeout_s, args.json) == (2, 7.5, True)


@pytest.mark.parametrize(
    ("how", "ended"),
    [
        ((0, 0, True, True), "reform"),  # the leader stopped its node to re-form
        ((0, 1, False, True), "reform"),  # rank 0 ended the pod
        ((0, 0, False, True), "done"),  # the node stopped by itself
        ((3, 0, False, True), "failed"),  # a rank died: the window failed
        ((-15, 1, True, False), "failed"),  # stopped while waiting for a lost leader
        ((2, 0, False, True), "failed"),  # a usage error after it ran: not a start failure
    ],
)
def test_how_a_rank_ended_is_how_the_generation_ended(
    tmp_path: Path, how: tuple[int, int, bool, bool], ended: str
) -> None:
    code, rank, asked, ready = how
    outcome = _generations(tmp_path)._outcome(code, rank, asked, ready, ["", "last words"])
    assert outcome.ended == ended
    if ended == "failed":
        assert f"rank {rank}" in outcome.reason and "last words" in outcome.reason


@pytest.mark.parametrize(("rank", "ready"), [(0, False), (1, False), (1, True)])
def test_a_rank_that_cannot_start_stops_the_member_with_its_reason(
    tmp_path: Path, rank: int, ready: bool
) -> None:
    with pytest.raises(LocalError, match=r"could not start: no experiment e+ at"):
        _generations(tmp_path)._outcome(2, rank, False, ready, [f"no experiment {'e' * 64} at"])


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--experiment", "e1"], "give --bootstrap URL"),
        (["--bootstrap", "127.0.0.1:9"], "without --experiment"),
        (["--experiment", "e1", "--bootstrap", "h:1", "--steps", "5"], "--steps with"),
        (["--experiment", "e1", "--bootstrap", "h:1", "--config", "a=1"], "--config with"),
    ],
)
def test_options_that_do_not_go_together_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], says: str
) -> None:
    secret = tmp_path / "cluster.secret"
    secret.write_text("ab" * 32)
    argv = ["cluster", "--secret-file", str(secret), "--dir", str(tmp_path / "m"), *options]
    assert main(argv) == LocalError.exit_code
    assert says in capsys.readouterr().err
