"""Two validators of three cut off for longer than a window deadline, then healed.

A real network (a seed, a reducer, three validators with quorum 2, two trainers) runs in
two Linux network namespaces (as root; skipped otherwise): validators 1 and 2 in one, joined
by a veth link to the root namespace, where the others run. The test cuts the link -- both
ends drop every packet, so sockets across it neither close nor answer -- for a random
1.5 to 2 window deadlines, during which neither side has a quorum and the trainers'
updates: no window can close. Then it heals the link: the window open then must close
within two window deadlines, nobody may have struck or banned the validators that were cut
off (a socket that went silent is nobody's offence), and every node end on one head with
the same weights.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.liveness import accusations, certify, chaos_rng, end_on_one_head
from tests.support.local_net import Net, new_net
from tests.support.netns import NetnsLab, netns_lab_fixture

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.netns]
__all__ = ["netns_lab_fixture"]

DEADLINE_S = 4.0
CUT_OFF = ("validator-1", "validator-2")


class Link:
    """The veth link between the root namespace and ``ns``; :meth:`cut` makes both ends
    drop every packet (a token bucket too small for any packet), :meth:`heal` undoes it."""

    def __init__(self, lab: NetnsLab, ns: str, subnet: int) -> None:
        self.ns = ns
        self.root_address, self.ns_address = lab.link(None, ns, subnet)
        self._ends = [
            (None, lab.device(None, self.root_address)),
            (ns, lab.device(ns, self.ns_address)),
        ]

    def cut(self) -> None:
        for ns, device in self._ends:
            self._tc(ns, "replace", device, "tbf", "rate", "8bit", "burst", "1", "latency", "1ms")

    def heal(self) -> None:
        for ns, device in self._ends:
            self._tc(ns, "del", device)

    @staticmethod
    def _tc(ns: str | None, verb: str, device: str, *qdisc: str) -> None:
        argv = ["tc", "qdisc", verb, "dev", device, "root", *qdisc]
        if ns is not None:
            argv = ["ip", "netns", "exec", ns, *argv]
        subprocess.run(argv, check=True, capture_output=True, timeout=30)


@pytest.fixture
def link(netns_lab: NetnsLab) -> Link:
    return Link(netns_lab, netns_lab.namespace("cut"), 1)


@pytest.fixture
def net(tmp_path: Path, link: Link) -> Iterator[Net]:
    net = new_net(tmp_path)
    try:
        launch(net, link)
        yield net
    finally:
        net.close()


def launch(net: Net, link: Link) -> None:
    """Start the network: validators 1 and 2 behind ``link``, the others in the root
    namespace, each serving on its side's address."""
    validators = [f"validator-{i}" for i in range(3)]
    path = net.write_experiment(
        validators=validators,
        reducers=["reducer-0"],
        quorum=2,
        min_updates=2,
        max_updates=3,
        deadline_s=DEADLINE_S,
        proposal_s=1.0,
    )
    here = ["--listen", f"{link.root_address}:0"]
    net.start("seed", "seed", args=["--experiment-toml", str(path), "--archive", *here])
    net.wait_ready(["seed"])
    net.start("reducer-0", "reducer", args=here)
    behind = [sys.executable, "-m", "p2ptrain"]
    for name in validators:
        if name in CUT_OFF:
            net.start(
                name,
                "validator",
                args=["--listen", f"{link.ns_address}:0"],
                program=["ip", "netns", "exec", link.ns, *behind],
            )
        else:
            net.start(name, "validator", args=here)
    for name in ("trainer-0", "trainer-1"):
        net.start(name, "trainer")
    net.wait_ready(net.names())


def test_a_healed_partition_closes_the_open_window_within_two_deadlines(
    net: Net, link: Link
) -> None:
    rng = chaos_rng(net)
    net.wait_height("seed", 1, 60)  # window 1 waits for the slow-starting trainers
    certify(net, net.names(), 1, 30, "everyone in step")

    seconds = DEADLINE_S * rng.uniform(1.5, 2.0)
    link.cut()
    net.note(
        f"{', '.join(CUT_OFF)} cut off for {seconds:.1f} s at heights "
        f"{dict(sorted(net.heights.items()))}"
    )
    net.watch(seconds)
    link.heal()
    healed = time.monotonic()
    height = max(net.heights.values())
    net.note(f"healed at heights {dict(sorted(net.heights.items()))}")
    net.wait(
        f"the window open at the heal (height {height + 1}) to close within two deadlines "
        f"({2 * DEADLINE_S:.0f} s) of it",
        2 * DEADLINE_S,
        lambda: net.heights.get("seed", 0) > height,
    )
    print(
        f"cut for {seconds:.1f} s; height {height + 1} certified "
        f"{time.monotonic() - healed:.1f} s after the heal"
    )
    for name in CUT_OFF:
        blamed = accusations(net, name)
        net.check(
            not blamed, f"{name} was struck or banned for the partition:\n" + "\n".join(blamed)
        )
    end_on_one_head(net, timeout_s=4 * DEADLINE_S)
