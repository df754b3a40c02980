"""The hivemind system of the convergence bench: real hivemind peers (with the anchors
interpreter, ``make bench-anchors``; skipped without it) average their parameters every epoch
and learn, in network namespaces as root, else on loopback; and, with stand-in peers (shell
scripts, no hivemind needed), the launcher passes rank 0's address on, reports a failing
peer at once, and kills and reaps every peer and what it started when a run fails or runs
late."""

from __future__ import annotations

import contextlib
import os
import select
import time
from pathlib import Path

import pytest
import torch

from p2ptrain.bench.chaos_network import TINY_WORKLOAD
from p2ptrain.bench.convergence_hivemind import (
    hivemind_python_candidate,
    hivemind_unavailable,
    run_hivemind,
)
from p2ptrain.bench.convergence_task import (
    LOOPBACK,
    Placement,
    Task,
    build_workload,
    load_snapshot,
    read_snapshots,
)
from p2ptrain.bench.netns_lab import NamespaceLab, namespaces_unavailable
from p2ptrain.errors import LocalError

pytestmark = [pytest.mark.integration]

TINY = dict(TINY_WORKLOAD)
# 50 inner steps: a step of the tiny model takes a few milliseconds, and hivemind learns of
# the other peers' progress through its DHT a few times a second; with 5 steps an epoch is
# over before the peers have heard of each other.
TASK = Task(workers=2, windows=3, inner_steps=50, config=TINY)


@pytest.fixture(scope="module")
def anchors_python() -> str:
    python = hivemind_python_candidate(None)
    reason = hivemind_unavailable(python)
    if reason is not None:
        pytest.skip(reason)
    return python


def _rounds(logs: list[Path]) -> str:
    """What each peer's hivemind said about its epochs and averaging rounds (verbose)."""
    told = []
    for log in logs:
        lines = log.read_text(errors="replace").splitlines()
        rounds = [line for line in lines if "averag" in line.lower() or "epoch #" in line]
        told.append(f"{log.name}:\n" + "\n".join(rounds[-30:]))
    return "\n".join(told)


def _train_and_check(python: str, workdir: Path, placement: Placement) -> None:
    run = run_hivemind(
        TASK, workdir, placement, ["a", "b"], python=python, timeout_s=120, verbose=True
    )
    assert run.epochs == [TASK.windows, TASK.windows]
    assert run.averaged_epochs >= 1, (
        f"no epoch averaged ({run.steps} steps, {run.inner_seconds} s in them): "
        f"see {run.logs}\n{_rounds(run.logs)}"
    )
    assert all(seconds > 0 for seconds in run.inner_seconds)
    assert run.launched < run.ended
    snapshots = read_snapshots(run.snapshots)
    assert snapshots[0].step == 0 and len(snapshots) >= 2
    assert snapshots[-1].samples == TASK.windows * TASK.workers * TASK.inner_steps * 8
    workload = build_workload(TASK)
    genesis = load_snapshot(snapshots[0])
    initial = workload.initial_weights()
    assert all(torch.equal(genesis[name], initial[name]) for name in initial)
    assert workload.evaluate(load_snapshot(snapshots[-1])) < workload.evaluate(genesis)


def test_two_hivemind_peers_average_every_epoch_and_learn(
    anchors_python: str, tmp_path: Path
) -> None:
    if namespaces_unavailable() is None:
        # the same peers and checks run in namespaces below (and the launcher's loopback
        # path, with stand-ins, further down): the run costs 40 s of CI
        pytest.skip("covered by test_hivemind_peers_train_in_network_namespaces here (root)")
    _train_and_check(anchors_python, tmp_path, LOOPBACK)


@pytest.mark.netns
def test_hivemind_peers_train_in_network_namespaces(anchors_python: str, tmp_path: Path) -> None:
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with NamespaceLab(["a", "b"], link_mbit=100) as lab:
        _train_and_check(anchors_python, tmp_path, lab)
        sent, received = lab.interface_bytes("a")
    # Three averages of a 9k-parameter model in fp32, at least.
    assert sent > 3 * 4 * 9_000 and received > 3 * 4 * 9_000


# A stand-in for the anchors interpreter: it records its arguments and its pid, starts a
# child of its own, says it is up, reads go, then either fails (rank FAIL) or hangs.
STAND_IN = """#!/bin/sh
rank=""
previous=""
for arg in "$@"; do
    [ "$previous" = "--rank" ] && rank="$arg"
    previous="$arg"
done
echo "$@" > {tmp}/args.$rank
sleep 1000 &
echo $! >> {tmp}/pids
echo $$ >> {tmp}/pids
echo 'hivemind-peer-ready ["/ip4/127.0.0.1/tcp/4001/p2p/rank'$rank'"]'
read line
if [ "$rank" = "{fail}" ]; then
    echo "rank $rank: the stand-in gives up" >&2
    exit 3
fi
exec sleep 1000
"""


def _stand_in(tmp_path: Path, fail: int | None) -> str:
    path = tmp_path / "python"
    path.write_text(STAND_IN.format(tmp=tmp_path, fail="" if fail is None else fail))
    path.chmod(0o755)
    return str(path)


def _assert_all_gone(pids_file: Path) -> None:
    """Every recorded process has exited (waited for through a pidfd: they need not be our
    children)."""
    pids = [int(line) for line in pids_file.read_text().split()]
    assert len(pids) == 4
    for pid in pids:
        try:
            handle = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # exited and reaped
        with contextlib.closing(os.fdopen(handle)):
            readable, _, _ = select.select([handle], [], [], 10)
            assert readable, f"process {pid} is still running"


def test_a_failing_peer_is_named_at_once_and_every_process_ends(tmp_path: Path) -> None:
    python = _stand_in(tmp_path, fail=1)
    began = time.monotonic()
    with pytest.raises(LocalError) as raised:
        run_hivemind(TASK, tmp_path / "run", LOOPBACK, ["a", "b"], python=python, timeout_s=60)
    assert time.monotonic() - began < 30  # not the run's time limit
    message = str(raised.value)
    assert "rank 1 (host b, 127.0.0.1) failed (status 3)" in message
    assert "the stand-in gives up" in message and "rank1.log" in message
    # Rank 1 was started with rank 0's address; rank 0 with none.
    assert "--initial-peers /ip4/127.0.0.1/tcp/4001/p2p/rank0" in (tmp_path / "args.1").read_text()
    assert "--initial-peers" not in (tmp_path / "args.0").read_text()
    _assert_all_gone(tmp_path / "pids")


def test_peers_that_run_late_are_killed_with_what_they_started(tmp_path: Path) -> None:
    python = _stand_in(tmp_path, fail=None)
    with pytest.raises(LocalError, match=r"rank 0 .* had not finished \(and 1 more\) within 2 s"):
        run_hivemind(TASK, tmp_path / "run", LOOPBACK, ["a", "b"], python=python, timeout_s=2)
    _assert_all_gone(tmp_path / "pids")


def test_a_peer_that_dies_before_it_is_up_is_reported(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'No module named hivemind' >&2\nexit 1\n")
    python.chmod(0o755)
    with pytest.raises(LocalError, match=r"rank 0 .* exited \(status 1\) before it was up"):
        run_hivemind(TASK, tmp_path, LOOPBACK, ["a", "b"], python=str(python), timeout_s=60)
    with pytest.raises(LocalError, match="one host per worker"):
        run_hivemind(TASK, tmp_path, LOOPBACK, ["a"], python=str(python), timeout_s=60)
