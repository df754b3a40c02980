"""A home cluster that trains in a p2ptrain network as one pod trainer.

One network for the module: a seed and a validator (q = 1) on loopback, and two members of
``p2ptrain cluster --experiment ID --bootstrap SEED`` (on loopback too: ``--no-mdns`` and
``--peer``; mDNS discovery has its own namespace test). Each generation of the cluster is a
pod: the leader's child is rank 0, the trainer node, and the other member's child is rank 1.
The test reads the members' JSON lines (their own events and rank 0's node events) and
checks that:

1. the two members form one generation of 2 and the network certifies heads holding the
   pod's update;
2. the leader is SIGKILLed (its node dies with it): the survivor reports it lost, re-forms
   alone as the leader, its own node takes the pod's place, and its updates are certified.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests.support.local_net import Net, new_net

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 5.0
WAIT_S = 120.0
STOP_S = 20.0

Event = dict[str, Any]


class Members:
    """``p2ptrain cluster`` processes; their JSON lines, in one queue."""

    def __init__(self, net: Net, work: Path) -> None:
        self.net, self.work = net, work
        self.secret = work / "cluster.secret"
        self.secret.write_text(os.urandom(32).hex() + "\n")
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.events: dict[str, list[Event]] = {}
        self._lines: queue.Queue[tuple[str, Event | None]] = queue.Queue()

    def start(self, label: str, *options: str) -> None:
        network = self.net.network
        assert network.seed is not None and network.seed.address is not None
        argv = [sys.executable, "-m", "p2ptrain", "cluster", "--json"]
        argv += ["--dir", str(self.work / label), "--secret-file", str(self.secret)]
        argv += ["--host", "127.0.0.1", "--no-mdns", "--threads", "1"]
        argv += ["--collective-timeout-s", "6", "--discovery-s", "0.5", "--settle-s", "1"]
        argv += ["--experiment", str(network.experiment_id)]
        argv += ["--bootstrap", network.seed.address, *options]
        stderr = (self.work / f"{label}.stderr").open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=stderr)  # fmt: skip
        stderr.close()
        self.processes[label] = process
        self.events[label] = []
        assert process.stdout is not None
        threading.Thread(target=self._forward, args=(label, process.stdout), daemon=True).start()

    def _forward(self, label: str, stdout: IO[bytes]) -> None:
        for line in stdout:
            try:
                self._lines.put((label, json.loads(line)))
            except ValueError:  # two events on one line: the member's output is broken
                self._lines.put(
                    (label, {"event": "garbled", "line": line.decode(errors="replace")})
                )
        self._lines.put((label, None))

    def wait_until(self, what: str, condition: Callable[[], bool]) -> None:
        """Take lines until ``condition()`` holds; fail after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not condition():
            try:
                label, event = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.fail(f"no {what} after {WAIT_S:g} s")
            if event is not None:
                self.events[label].append(event)
                if event["event"] == "garbled":
                    self.fail(
                        f"member {label} printed a line that is not one event: {event['line']!r}"
                    )

    def fail(self, message: str) -> None:
        tails = "\n".join(
            f"--- {label} stderr:\n{(self.work / f'{label}.stderr').read_text()[-2000:]}"
            for label in self.processes
        )
        kinds = {label: [e["event"] for e in events] for label, events in self.events.items()}
        pytest.fail(f"{message}\nevents: {kinds}\n{tails}\n{self.net.diagnosis()}")

    def of(self, label: str, kind: str) -> list[Event]:
        return [e for e in self.events[label] if e["event"] == kind]

    def accepted(self, label: str, after: int = 0) -> list[int]:
        """Heights whose certified head holds the update of ``label``'s node."""
        return [
            e["height"] for e in self.of(label, "adopted")
            if e.get("update") == "accepted" and e["height"] > after
        ]  # fmt: skip

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Members]:
    net = new_net(tmp_path_factory.mktemp("cluster-pod"))
    started = Members(net, tmp_path_factory.mktemp("members"))
    try:
        path = net.write_experiment(
            validators=["validator-0"], quorum=1, max_updates=2, deadline_s=DEADLINE_S
        )
        net.start("seed", "seed", args=["--experiment-toml", str(path)])
        net.wait_ready(["seed"])
        net.start("validator-0", "validator")
        net.wait_ready(["validator-0"])
        started.start("a", "--wait-for", "2")
        started.wait_until("member a's address", lambda: bool(started.of("a", "started")))
        started.start("b", "--wait-for", "2", "--peer", started.of("a", "started")[0]["address"])
        yield started
    finally:
        started.stop()
        net.close()


def _leader(members: Members) -> tuple[str, str]:
    """(leader's label, the other's) of the first generation."""
    formed = {label: members.of(label, "generation_formed")[0] for label in ("a", "b")}
    leader = next(label for label, e in formed.items() if e["rank"] == 0)
    return leader, "b" if leader == "a" else "a"


def test_the_cluster_trains_in_the_network_as_one_pod(members: Members) -> None:
    members.wait_until(
        "generation of both members",
        lambda: all(members.of(label, "generation_formed") for label in ("a", "b")),
    )
    worlds = {label: members.of(label, "generation_formed")[0]["world"] for label in "ab"}
    assert worlds == {"a": 2, "b": 2}, worlds
    leader, _ = _leader(members)
    members.wait_until(
        "two certified heads holding the pod's update", lambda: len(members.accepted(leader)) >= 2
    )
    trained = members.of(leader, "trained")
    assert all(e["loss_after"] < e["loss_before"] + 1.0 for e in trained), trained
    steps = members.of(leader, "step")
    assert steps and {e["generation"] for e in steps} == {
        members.of(leader, "generation_formed")[0]["generation"]
    }, steps


def test_the_survivor_of_the_leader_trains_on_as_the_pod(members: Members) -> None:
    leader, survivor = _leader(members)
    height = max(members.accepted(leader))
    members.processes[leader].kill()
    members.wait_until(
        "the survivor's report of the lost leader",
        lambda: any(e["peer"] for e in members.of(survivor, "member_lost")),
    )
    members.wait_until(
        "the survivor's new generation",
        lambda: len(members.of(survivor, "generation_formed")) >= 2,
    )
    again = members.of(survivor, "generation_formed")[-1]
    assert (again["world"], again["rank"]) == (1, 0), again
    members.wait_until(
        "a certified head holding the survivor's update",
        lambda: bool(members.accepted(survivor, after=height)),
    )
