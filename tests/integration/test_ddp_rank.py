"""Real torch DDP (gloo) on a tiny convergence task, two ranks as two processes: on loopback,
rank 0 leaves a snapshot before training, every window and at the end, the run learns, and
both ranks end on exactly the same weights (the gradients were all-reduced). In a namespace
lab (root only, skipped otherwise) the all-reduce crosses each host's shaped link."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from p2ptrain.bench.chaos_network import TINY_WORKLOAD
from p2ptrain.bench.convergence_ddp import DdpRun, run_ddp
from p2ptrain.bench.convergence_task import (
    LOOPBACK,
    Placement,
    Task,
    build_workload,
    load_snapshot,
    read_done,
    read_snapshots,
)
from p2ptrain.bench.netns_lab import NamespaceLab, namespaces_unavailable
from p2ptrain.errors import LocalError

pytestmark = pytest.mark.integration

HOSTS = ["h0", "h1"]
TASK = Task(
    workers=2,
    windows=2,
    inner_steps=3,
    config=dict(TINY_WORKLOAD),
)


def _run(tmp_path: Path, placement: Placement) -> DdpRun:
    return run_ddp(TASK, tmp_path / "ddp", placement, HOSTS, timeout_s=120)


def _final(directory: Path) -> dict[str, torch.Tensor]:
    snapshots = read_snapshots(directory)
    assert snapshots and snapshots[-1].step == TASK.steps
    return load_snapshot(snapshots[-1])


def test_ddp_ranks_train_in_step_and_leave_snapshots(tmp_path: Path) -> None:
    run = _run(tmp_path, LOOPBACK)

    assert run.launched < run.ended
    assert len(run.rank_dirs) == len(run.logs) == len(run.inner_seconds) == 2
    for directory in run.rank_dirs:
        done = read_done(directory)
        assert done is not None and done["steps"] == TASK.steps and done["inner_seconds"] > 0
    assert all(log.is_file() for log in run.logs)

    snapshots = read_snapshots(run.snapshots)
    assert [s.step for s in snapshots] == [0, 3, 6]
    assert [s.samples for s in snapshots] == [0, 3 * 2 * 8, 6 * 2 * 8]
    assert all(run.launched <= s.time <= run.ended for s in snapshots)

    workload = build_workload(TASK)
    genesis, last = load_snapshot(snapshots[0]), load_snapshot(snapshots[-1])
    assert genesis.keys() == workload.initial_weights().keys()
    assert all(torch.equal(genesis[k], v) for k, v in workload.initial_weights().items())
    assert any(not torch.equal(genesis[k], last[k]) for k in genesis)
    assert workload.evaluate(last) < workload.evaluate(genesis)

    rank0, rank1 = _final(run.rank_dirs[0]), _final(run.rank_dirs[1])
    assert rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)


def test_a_failing_rank_is_named_with_its_log_and_the_others_are_stopped(
    tmp_path: Path,
) -> None:
    # Rank 1 dies before it joins; rank 0 would wait for it until the timeout.
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case "$*" in *"--rank 1 "*) echo "rank 1 refuses" >&2; exit 3;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(LocalError, match=r"DDP rank 1 exited with status 3") as caught:
        run_ddp(TASK, tmp_path / "ddp", LOOPBACK, HOSTS, python=str(wrapper), timeout_s=120)
    assert "rank 1 refuses" in str(caught.value)
    assert time.monotonic() - started < 60


def test_ranks_that_run_past_the_timeout_are_killed_and_reaped(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 1000\n")
    wrapper.chmod(0o755)
    with pytest.raises(LocalError, match=r"DDP ranks 0, 1 did not finish within 2 s"):
        run_ddp(TASK, tmp_path / "ddp", LOOPBACK, HOSTS, python=str(wrapper), timeout_s=2)
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 2
    for pid in started:  # neither running nor a zombie left to reap
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_rank_that_cannot_start_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-python")
    with pytest.raises(LocalError, match=r"cannot start DDP rank 0 on host h0"):
        run_ddp(TASK, tmp_path / "ddp", LOOPBACK, HOSTS, python=missing, timeout_s=60)


def test_ddp_all_reduce_crosses_each_hosts_link(tmp_path: Path) -> None:
    reason = namespaces_unavailable(("ip", "tc"))
    if reason is not None:
        pytest.skip(reason)
    workload = build_workload(TASK)
    gradient_bytes = 4 * sum(p.numel() for p in workload.model.parameters())
    with NamespaceLab(HOSTS, link_mbit=100) as lab:
        before = {host: lab.interface_bytes(host) for host in HOSTS}
        run = _run(tmp_path, lab)
        after = {host: lab.interface_bytes(host) for host in HOSTS}

    assert [s.step for s in read_snapshots(run.snapshots)] == [0, 3, 6]
    rank0, rank1 = _final(run.rank_dirs[0]), _final(run.rank_dirs[1])
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    # A ring all-reduce of two ranks sends and receives 2 (N-1)/N = 1 gradient per step.
    least = gradient_bytes * TASK.steps
    for host in HOSTS:
        sent = after[host][0] - before[host][0]
        received = after[host][1] - before[host][1]
        assert sent > least and received > least, (host, sent, received, least)
