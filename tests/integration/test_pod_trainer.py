"""A trainer made of a pod of two gloo ranks under torchrun, beside a single trainer.

One network for the module: a seed, a validator (q = 1), a single trainer and a pod trainer
started with ``p2ptrain train --pod-ranks 2`` (torchrun, DDP on gloo). The pod's updates are
accepted into certified heads like any trainer's. Then rank 1 of the pod is stopped
(SIGSTOP): the pod's window fails within the pod's collective timeout, the network certifies
that window without the pod, and once rank 1 is killed torchrun starts the pod again, which
resumes from its saved state and has its updates accepted again.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.local_net import Net, new_net

pytestmark = pytest.mark.integration

DEADLINE_S = 5.0
POD_TIMEOUT_S = 4.0
WAIT_S = 120.0


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    net = new_net(tmp_path_factory.mktemp("pod-trainer"))
    try:
        path = net.write_experiment(
            validators=["validator-0"], quorum=1, max_updates=2, deadline_s=DEADLINE_S
        )
        net.start("seed", "seed", args=["--experiment-toml", str(path)])
        net.wait_ready(["seed"])
        net.start("validator-0", "validator")
        net.start("trainer-0", "trainer")
        net.start(
            "pod", "trainer", args=["--pod-ranks", "2", "--pod-timeout-s", str(POD_TIMEOUT_S)]
        )
        net.wait_ready(["validator-0", "trainer-0", "pod"])
        yield net
    finally:
        ranks = _pod_ranks(net)  # found by their parent, torchrun, while it runs
        for pid in ranks:
            _signal(pid, signal.SIGCONT)
        net.close()
        for pid in ranks:  # torchrun reaps its ranks, and a rank exits without it; never
            _signal(pid, signal.SIGKILL)  # leave one behind holding the node's output pipe


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _pod_ranks(net: Net) -> dict[int, int]:
    """``{pid: rank}`` of the processes torchrun started for the pod."""
    node = net.network.nodes.get("pod")
    if node is None:
        return {}
    ranks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent != node.process.pid:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for variable in environ:
            if variable.startswith(b"RANK="):
                ranks[int(entry.name)] = int(variable[5:])
    return ranks


def _accepted(net: Net, name: str) -> list[int]:
    """Heights at which ``name``'s own update was accepted."""
    return [e["height"] for e in net.events("adopted", name) if e.get("update") == "accepted"]


def _adopted(net: Net, name: str, height: int) -> dict[str, Any] | None:
    return next((e for e in net.events("adopted", name) if e["height"] == height), None)


def test_pod_updates_are_certified(net: Net) -> None:
    net.wait(
        "three certified heads with the pod's update and the single trainer's",
        WAIT_S,
        lambda: len(_accepted(net, "pod")) >= 3 and len(_accepted(net, "trainer-0")) >= 3,
    )
    ranks = sorted(_pod_ranks(net).values())
    net.check(ranks == [0, 1], f"the pod runs ranks 0 and 1 under torchrun: {ranks}")
    trained = net.events("trained", "pod")
    net.check(
        all(e["loss_after"] < e["loss_before"] + 1.0 for e in trained),
        f"the pod's losses are those of training: {trained[-3:]}",
    )


def test_a_stalled_rank_fails_the_window_and_the_pod_comes_back(net: Net) -> None:
    ranks = {rank: pid for pid, rank in _pod_ranks(net).items()}
    net.check(1 in ranks, f"the pod's rank 1 runs: {ranks}")
    failed_before = len(net.events("role_error", "pod"))
    ready_before = len(net.events("ready", "pod"))
    _signal(ranks[1], signal.SIGSTOP)
    net.note(f"pod rank 1 (pid {ranks[1]}) stopped")
    net.wait(
        "the pod's window to fail within its collective timeout",
        WAIT_S,
        lambda: len(net.events("role_error", "pod")) > failed_before,
    )
    failure = net.events("role_error", "pod")[failed_before]
    window = failure["window"]
    net.check("rank of this pod" in failure["message"], f"the failure names the pod: {failure}")
    net.wait(
        f"the network to certify window {window} without the pod",
        WAIT_S,
        lambda: _adopted(net, "validator-0", window) is not None,
    )
    adopted = _adopted(net, "validator-0", window)
    assert adopted is not None
    net.check(adopted["accepted"] == 1, f"window {window} holds the single trainer's update only")
    _signal(ranks[1], signal.SIGKILL)
    _signal(ranks[1], signal.SIGCONT)
    net.wait(
        "torchrun to start the pod again",
        WAIT_S,
        lambda: len(net.events("ready", "pod")) > ready_before,
    )
    net.wait(
        f"the restarted pod's update accepted after window {window}",
        WAIT_S,
        lambda: any(h > window for h in _accepted(net, "pod")),
    )
    restarted = _pod_ranks(net)
    net.check(
        sorted(restarted.values()) == [0, 1] and ranks[1] not in restarted,
        f"torchrun started both ranks again: {restarted}",
    )
