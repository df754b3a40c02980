"""A home cluster between real processes, each member in its own network namespace.

The members (``p2ptrain cluster --json``) sit on one LAN: a bridge in a namespace of its
own, a veth link to it from each member's namespace, every member's address in one /24, so
mDNS multicast reaches them all. The test reads their JSON event lines (it waits for lines,
never sleeps) and checks, in one run:

1. a, b and c find each other by mDNS and train; the most senior (the lowest peer id, as
   none has trained yet) leads generation 0;
2. the leader is SIGKILLed: the two survivors re-form under the next most senior and train
   on from the last step they completed (the highest of theirs: nothing but the step in
   flight is lost), and report the leader lost;
3. d, started later, joins at the next re-form, from the step the survivors reached;
4. w, whose secret file differs, is refused: it says the secret differs and exits non-zero.

The identities (and so who leads) come from a seed printed at the start and on failure
(``P2PTRAIN_TEST_SEED`` replays one).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from p2ptrain.bench.netns_lab import ip
from p2ptrain.core.identity import Identity
from p2ptrain.store.keyfile import identity_path
from tests.support.netns import NetnsLab, netns_lab_fixture  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.netns]

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 45.0
STOP_S = 15.0
TINY = ("n_layer=1", "n_embd=16", "n_head=2", "block_size=16", "batch_size=4", "val_blocks=8")
LABELS = ("a", "b", "c", "d", "w")

Event = dict[str, Any]


class Lan:
    """One broadcast domain: a bridge in namespace ``sw``, a namespace per member."""

    def __init__(self, lab: NetnsLab, labels: tuple[str, ...]) -> None:
        switch = lab.namespace("sw")
        ip("link", "add", "br0", "type", "bridge", ns=switch)
        ip("link", "set", "br0", "up", ns=switch)
        self.hosts: dict[str, tuple[str, str]] = {}
        for index, label in enumerate(labels, start=1):
            ns = lab.namespace(label)
            here, there = lab.link(ns, switch, subnet_index=index)
            device, port = lab.device(ns, here), lab.device(switch, there)
            ip("addr", "flush", "dev", device, ns=ns)  # gloo binds the device's first address
            ip("addr", "flush", "dev", port, ns=switch)
            address = f"10.{lab.second_octet}.0.{index}"
            ip("addr", "add", f"{address}/24", "dev", device, ns=ns)
            ip("link", "set", port, "master", "br0", ns=switch)
            self.hosts[label] = (ns, address)


class Members:
    """Cluster members started in a lab; their JSON lines merged into one queue."""

    def __init__(self, lab: NetnsLab, lan: Lan, work: Path, seed: int) -> None:
        self.lab, self.lan, self.work, self.seed = lab, lan, work, seed
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.events: dict[str, list[Event]] = {}
        self.ended: set[str] = set()
        self._lines: queue.Queue[tuple[str, Event | None]] = queue.Queue()
        self.peer: dict[str, str] = {}

    def start(self, label: str, secret: Path, *options: str) -> None:
        directory = self.work / label
        directory.mkdir()
        identity = Identity.from_seed(hashlib.sha256(f"{self.seed}:{label}".encode()).digest())
        key = identity_path(directory)
        key.write_bytes(identity.to_pem())
        key.chmod(0o600)
        self.peer[label] = identity.peer_id
        ns, address = self.lan.hosts[label]
        argv = [sys.executable, "-m", "p2ptrain", "cluster", "--json", "--dir", str(directory)]
        argv += ["--secret-file", str(secret), "--host", address, "--threads", "1"]
        argv += ["--collective-timeout-s", "5", "--discovery-s", "1", "--settle-s", "2"]
        argv += [f"--config={pair}" for pair in TINY] + list(options)
        env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME",)}
        stderr = (self.work / f"{label}.stderr").open("wb")
        process = self.lab.popen(ns, argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=stderr)  # fmt: skip
        stderr.close()
        self.processes[label] = process
        self.events[label] = []
        assert process.stdout is not None
        threading.Thread(target=self._forward, args=(label, process.stdout), daemon=True).start()

    def _forward(self, label: str, stdout: IO[bytes]) -> None:
        for line in stdout:
            self._lines.put((label, json.loads(line)))
        self._lines.put((label, None))

    def stderr(self, label: str) -> str:
        return (self.work / f"{label}.stderr").read_text(errors="replace")

    def _fail(self, message: str) -> None:
        tails = "\n".join(f"--- {label} stderr:\n{self.stderr(label)[-1500:]}"
                          for label in self.processes)  # fmt: skip
        counts = {label: [e["event"] for e in events if e["event"] != "step"]
                  for label, events in self.events.items()}  # fmt: skip
        pytest.fail(f"seed {self.seed}: {message}\nevents: {counts}\n{tails}")

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        """Consume lines until ``condition()`` holds; fail after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not condition():
            try:
                label, event = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._fail(f"no {what} after {WAIT_S:g} s")
            if event is None:
                self.ended.add(label)
            else:
                self.events[label].append(event)

    def of(self, label: str, kind: str) -> list[Event]:
        return [e for e in self.events[label] if e["event"] == kind]

    def generation(self, label: str, after: int = -1) -> Event | None:
        """The first generation ``label`` formed with a number above ``after``."""
        formed = self.of(label, "generation_formed")
        return next((e for e in formed if e["generation"] > after), None)

    def formed(self, label: str, after: int = -1) -> Event:
        event = self.generation(label, after)
        assert event is not None, (self.seed, label, after)
        return event

    def steps(self, label: str, generation: int) -> list[int]:
        return [e["step"] for e in self.of(label, "step") if e["generation"] == generation]

    def last_step_before(self, label: str, formed: Event) -> int:
        """The last step ``label`` completed before it reported ``formed``."""
        events = self.events[label]
        before = events[: events.index(formed)]
        return max((e["step"] for e in before if e["event"] == "step"), default=0)

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


@pytest.fixture
def members(netns_lab: NetnsLab, tmp_path: Path) -> Any:
    seed = int(os.environ.get("P2PTRAIN_TEST_SEED") or secrets.randbits(32))
    print(f"home cluster test seed {seed} (P2PTRAIN_TEST_SEED={seed} replays it)")
    started = Members(netns_lab, Lan(netns_lab, LABELS), tmp_path, seed)
    try:
        yield started
    finally:
        started.stop()


def _secret_file(path: Path, rng: random.Random) -> Path:
    path.write_text(rng.randbytes(32).hex() + "\n")
    return path


def test_cluster_survives_its_leader_takes_a_joiner_and_refuses_a_stranger(
    members: Members, tmp_path: Path
) -> None:
    rng = random.Random(members.seed)
    secret = _secret_file(tmp_path / "cluster.secret", rng)
    wrong = _secret_file(tmp_path / "other.secret", rng)

    # 1. Three members find each other and train; the most senior leads.
    founders = ("a", "b", "c")
    for label in founders:
        members.start(label, secret, "--wait-for", "3")
    members.wait_until(lambda: all(members.generation(m) for m in founders), "generation 0")
    first = {m: members.formed(m) for m in founders}
    assert {(e["generation"], e["world"], e["leader"]) for e in first.values()} == {
        (0, 3, min(members.peer[m] for m in founders))
    }, (members.seed, first)
    (leader,) = (m for m in founders if members.peer[m] == first["a"]["leader"])
    number = 0
    members.wait_until(
        lambda: all(len(members.steps(m, number)) >= 3 for m in founders), "three steps"
    )

    # 2. The leader dies; the survivors re-form under the next most senior, from the last
    # step completed (the highest of theirs: only the step in flight may be lost).
    survivors = tuple(m for m in founders if m != leader)
    seen_before_kill = max(max(members.steps(m, number)) for m in survivors)
    members.processes[leader].send_signal(signal.SIGKILL)
    members.wait_until(
        lambda: all(members.generation(m, number) for m in survivors), "a re-formed generation"
    )
    second = {m: members.formed(m, number) for m in survivors}
    again = second[survivors[0]]
    shared = {(e["generation"], e["world"], e["leader"], e["start_step"]) for e in second.values()}
    assert shared == {(again["generation"], 2, again["leader"], again["start_step"])}, shared
    assert again["leader"] == min(members.peer[m] for m in survivors), (members.seed, again)
    completed = max(members.last_step_before(m, e) for m, e in second.items())
    assert again["start_step"] == completed >= seen_before_kill, (members.seed, again, completed)
    for m in survivors:
        assert any(e["peer"] == members.peer[leader] for e in members.of(m, "member_lost")), m
    number = again["generation"]
    members.wait_until(
        lambda: all(len(members.steps(m, number)) >= 2 for m in survivors), "training on"
    )
    assert all(min(members.steps(m, number)) == completed + 1 for m in survivors)

    # 3. d joins at the next re-form; 4. w, with another secret, is refused.
    members.start("d", secret)
    members.start("w", wrong, "--wait-for", "2")
    members.wait_until(lambda: bool(members.of("d", "step")), "d training")
    joined = members.formed("d")
    assert joined["world"] == 3, (members.seed, joined)
    assert set(joined["members"]) == {members.peer[m] for m in (*survivors, "d")}
    third = {m: members.formed(m, number) for m in survivors}
    for theirs in third.values():
        assert (theirs["generation"], theirs["start_step"]) == (
            joined["generation"],
            joined["start_step"],
        )
    reached = max(members.last_step_before(m, e) for m, e in third.items())
    assert joined["start_step"] == reached, (members.seed, joined, reached)
    members.wait_until(lambda: "w" in members.ended, "w giving up")
    assert members.processes["w"].wait(timeout=STOP_S) == 3
    (gave_up,) = [e for e in members.of("w", "refused") if e["fatal"]]
    assert "the cluster secret differs" in gave_up["reason"], gave_up
    assert "the cluster secret differs" in members.stderr("w")
    assert "--secret-file" in members.stderr("w")
    _, w_address = members.lan.hosts["w"]
    told = [e for m in (*survivors, "d") for e in members.of(m, "refused")]
    assert any(w_address in e["address"] for e in told), told
    assert not any(e["fatal"] for e in told)

    # Asked to stop, every member leaves at a step boundary and exits cleanly.
    members.stop()
    codes = {m: members.processes[m].returncode for m in (*survivors, "d")}
    assert codes == dict.fromkeys(codes, 0), (members.seed, codes)
