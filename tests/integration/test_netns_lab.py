"""The chaos bench's namespace lab: every host reaches every other over its lab address, a
partition cuts exactly the hosts named off from the rest (they still reach each other) and
healing joins them again. Needs root (skipped otherwise)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from p2ptrain.bench.netns_lab import NamespaceLab, namespaces_unavailable

pytestmark = [pytest.mark.integration, pytest.mark.netns]

HOSTS = ["a", "b", "c"]
PORT = 9000
SERVE = (
    "import socket, sys\n"
    "s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()\n"
    "print('up', flush=True)\n"
    "while True:\n"
    "    s.accept()[0].close()\n"
)
DIAL = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)"


def _serve(lab: NamespaceLab, host: str) -> subprocess.Popen[str]:
    argv = [*lab.command_prefix(host), sys.executable, "-c", SERVE, lab.address[host], str(PORT)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


@pytest.fixture
def lab() -> Iterator[NamespaceLab]:
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with NamespaceLab(HOSTS) as lab:
        servers = [_serve(lab, host) for host in HOSTS]
        try:
            for server in servers:
                assert server.stdout is not None and server.stdout.readline() == "up\n"
            yield lab
        finally:
            for server in servers:
                server.kill()
                server.wait()
                if server.stdout is not None:
                    server.stdout.close()


def _reaches(lab: NamespaceLab, source: str, target: str) -> bool:
    argv = [*lab.command_prefix(source), sys.executable, "-c", DIAL, lab.address[target],
            str(PORT)]  # fmt: skip
    return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode == 0


def _reachable(lab: NamespaceLab) -> set[tuple[str, str]]:
    return {(s, t) for s in HOSTS for t in HOSTS if s != t and _reaches(lab, s, t)}


def test_a_partition_cuts_the_hosts_named_and_healing_joins_them(lab: NamespaceLab) -> None:
    everyone = {(s, t) for s in HOSTS for t in HOSTS if s != t}
    assert len(set(lab.address.values())) == len(HOSTS)
    assert _reachable(lab) == everyone
    lab.cut(["a", "b"])
    assert lab.cut_off == ("a", "b")
    assert _reachable(lab) == {("a", "b"), ("b", "a")}
    lab.cut(["c"])  # a new partition heals the old one first
    assert _reachable(lab) == {("a", "b"), ("b", "a")}
    lab.heal()
    assert lab.cut_off == ()
    assert _reachable(lab) == everyone
