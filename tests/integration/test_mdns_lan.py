"""LAN discovery between real processes in Linux network namespaces.

Each child (``tests/support/mdns_child.py``) runs LanDiscovery and prints JSON lines; the test
waits for the lines it expects (never sleeps) and checks, after every child has stopped, that
a node of another network was never reported and no peer was reported twice.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.builders import h
from tests.support.netns import NetnsLab, netns_lab_fixture  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.netns]

ROOT = Path(__file__).resolve().parents[2]
CHILD = "tests.support.mdns_child"
WAIT_S = 30.0
NET, OTHER_NET = h("lan network"), h("another lan network")
PEERS = {label: h(f"lan peer {label}") for label in ("alice", "bob", "carol", "dave")}

Event = dict[str, Any]


class Children:
    """Children started in a lab, their stdout JSON lines merged into one queue."""

    def __init__(self, lab: NetnsLab) -> None:
        self.lab = lab
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.events: dict[str, list[Event]] = {}
        self._lines: queue.Queue[tuple[str, Event | None]] = queue.Queue()

    def start(self, label: str, ns: str, network_id: str, *options: str) -> None:
        argv = [sys.executable, "-m", CHILD, network_id, PEERS[label], *options]
        process = self.lab.popen(ns, argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.processes[label] = process
        self.events[label] = []
        threading.Thread(target=self._forward, args=(label, process), daemon=True).start()

    def _forward(self, label: str, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self._lines.put((label, json.loads(line)))
        self._lines.put((label, None))  # end of output

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        """Consume lines until ``condition()`` holds; fail after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not condition():
            try:
                label, event = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {what} after {WAIT_S}s; events: {self.events}")
            if event is None:
                code = self.processes[label].wait()
                if not self.stopped(label):
                    pytest.fail(f"{label} exited with {code} before {what}: {self.events}")
            else:
                self.events[label].append(event)

    def wait_ready(self) -> None:
        self.wait_until(lambda: all(self.last(c, "ready") for c in self.processes), "all ready")

    def last(self, label: str, kind: str) -> Event | None:
        return next((e for e in reversed(self.events[label]) if e["event"] == kind), None)

    def port(self, label: str) -> int:
        ready = self.last(label, "ready")
        assert ready is not None
        return int(ready["port"])

    def found(self, label: str) -> list[tuple[str, str]]:
        return [(e["peer_id"], e["address"]) for e in self.events[label] if e["event"] == "found"]

    def ignored(self, label: str) -> int:
        statistics = self.last(label, "statistics")
        return 0 if statistics is None else int(statistics["records_ignored"])

    def stopped(self, label: str) -> bool:
        return self.last(label, "stopped") is not None

    def stop_all(self) -> None:
        """Close every child's stdin (a clean stop with goodbyes) and wait for them to exit."""
        for process in self.processes.values():
            assert process.stdin is not None
            process.stdin.close()
        self.wait_until(lambda: all(map(self.stopped, self.processes)), "clean stop")
        for label, process in self.processes.items():
            assert process.wait(timeout=WAIT_S) == 0, label


def test_two_namespaces_find_each_other_and_not_another_network(netns_lab: NetnsLab) -> None:
    a, b = netns_lab.namespace("a"), netns_lab.namespace("b")
    address_a, address_b = netns_lab.link(a, b, subnet_index=1)
    children = Children(netns_lab)
    children.start("alice", a, NET)
    children.start("bob", b, NET)
    children.start("carol", b, OTHER_NET)  # shares bob's namespace, sees both of them
    children.wait_ready()
    bob_seen = (PEERS["bob"], f"http://{address_b}:{children.port('bob')}")
    alice_seen = (PEERS["alice"], f"http://{address_a}:{children.port('alice')}")

    children.wait_until(
        lambda: bob_seen in children.found("alice") and alice_seen in children.found("bob"),
        "alice and bob finding each other",
    )
    # Everyone has heard carol (or carol them) when each has ignored another network's record.
    children.wait_until(
        lambda: (
            children.ignored("alice") >= 1
            and children.ignored("bob") >= 1
            and children.ignored("carol") >= 2
        ),
        "carol's network ignored on both sides of the link",
    )
    children.stop_all()
    assert children.found("alice") == [bob_seen]
    assert children.found("bob") == [alice_seen]
    assert children.found("carol") == []


def test_loopback_multicast_in_a_fresh_namespace(netns_lab: NetnsLab) -> None:
    ns = netns_lab.namespace("lo")
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "multicast", "on"], check=True)
    lo = ("--interface", "127.0.0.1")
    children = Children(netns_lab)
    children.start("alice", ns, NET, *lo)
    children.start("bob", ns, NET, *lo, "--tls")
    children.start("carol", ns, OTHER_NET, *lo)
    children.start("dave", ns, NET, *lo, "--browse-only")
    children.wait_ready()
    alice_seen = (PEERS["alice"], f"http://127.0.0.1:{children.port('alice')}")
    bob_seen = (PEERS["bob"], f"https://127.0.0.1:{children.port('bob')}")
    assert children.port("dave") == 0

    children.wait_until(
        lambda: (
            bob_seen in children.found("alice")
            and alice_seen in children.found("bob")
            and {alice_seen, bob_seen} <= set(children.found("dave"))
            and all(children.ignored(c) >= 1 for c in ("alice", "bob", "dave"))
            and children.ignored("carol") >= 2
        ),
        "every node of the network finding the announcing others, carol ignored",
    )
    children.stop_all()
    assert children.found("alice") == [bob_seen]
    assert children.found("bob") == [alice_seen]
    assert sorted(children.found("dave")) == sorted([alice_seen, bob_seen])
    assert children.found("carol") == []
    final = children.last("dave", "stopped")
    assert final is not None and final["peers_found"] == 2 and final["records_ignored"] >= 1
    assert not any(e["announced"] for e in children.events["dave"] if e["event"] == "statistics")
