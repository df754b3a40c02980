"""Linux network namespaces for tests: isolated hosts joined by veth links.

A :class:`NetnsLab` creates namespaces, veth pairs between them (or to the root namespace),
``tc`` shaping, and processes inside them, and removes all of it on :meth:`NetnsLab.close`
(also at interpreter exit). Every name carries the lab's random tag, so labs running at the
same time do not collide. IP forwarding is never enabled: a namespace linked only to the root
namespace cannot reach another namespace linked to root, which is how NAT tests model "no
inbound route".

Tests take the ``netns_lab`` fixture (it skips with the reason when namespaces are
unavailable). Import it under its function name, so that ruff does not see the test's
``netns_lab`` parameter as redefining an import (F811)::

    from tests.support.netns import NetnsLab, netns_lab_fixture  # noqa: F401

    def test_something(netns_lab: NetnsLab) -> None: ...
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import pytest

from p2ptrain.bench.netns_lab import free_second_octet, ip, namespaces_unavailable

PREFIX = "p2pt"
TERM_GRACE_S = 3.0
_LABEL = re.compile(r"[A-Za-z0-9_-]{1,32}")


@functools.cache
def netns_unavailable() -> str | None:
    """Why this process cannot create network namespaces and shape links, or None."""
    return namespaces_unavailable(("ip", "tc"))


class NetnsLab:
    """Namespaces, veth links, shaping and processes that are all removed by :meth:`close`."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)[:5]  # names: p2pt + 5 + up to 6 = 15 characters
        self.second_octet = free_second_octet()
        print(f"netns lab {self.tag}: subnets 10.{self.second_octet}.<index>.0/24")
        self._namespaces: list[str] = []
        self._veths: list[tuple[str | None, str]] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        self._links = 0
        self._closed = False
        atexit.register(self.close)

    def __enter__(self) -> NetnsLab:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def namespace(self, label: str) -> str:
        """Create a namespace with ``lo`` up; return its name."""
        if not _LABEL.fullmatch(label):
            raise ValueError(f"namespace label must be 1-32 of [A-Za-z0-9_-], got {label!r}")
        name = f"{PREFIX}{self.tag}-{label}"
        ip("netns", "add", name)
        self._namespaces.append(name)
        ip("link", "set", "lo", "up", ns=name)
        return name

    def link(self, ns_a: str | None, ns_b: str | None, subnet_index: int) -> tuple[str, str]:
        """A veth pair ``ns_a`` <-> ``ns_b`` (None: the root namespace), addresses
        10.<lab>.<subnet_index>.1/24 and .2/24, both up; returns (addr_a, addr_b)."""
        if ns_a == ns_b:
            raise ValueError("a link joins two different namespaces")
        if not 0 <= subnet_index <= 255:
            raise ValueError(f"subnet_index must be 0-255, got {subnet_index}")
        self._links += 1
        ends = [
            (ns_a, f"{PREFIX}{self.tag}{self._links}a"),
            (ns_b, f"{PREFIX}{self.tag}{self._links}b"),
        ]
        args = ["link", "add", ends[0][1]]
        args += ["netns", ns_a] if ns_a is not None else []
        args += ["type", "veth", "peer", "name", ends[1][1]]
        args += ["netns", ns_b] if ns_b is not None else []
        ip(*args)
        self._veths.append(ends[0])
        addresses = []
        for host, (ns, device) in enumerate(ends, start=1):
            address = f"10.{self.second_octet}.{subnet_index}.{host}"
            ip("addr", "add", f"{address}/24", "dev", device, ns=ns)
            _never_forward(ns, device)
            ip("link", "set", device, "up", ns=ns)
            addresses.append(address)
        return addresses[0], addresses[1]

    def device(self, ns: str | None, address: str) -> str:
        """The name of the veth end in ``ns`` that holds ``address``."""
        for line in ip("-o", "-4", "addr", "show", ns=ns).splitlines():
            fields = line.split()
            if fields[3].split("/")[0] == address:
                return fields[1]
        raise KeyError(f"no device with {address} in {ns or 'the root namespace'}")

    def shape(
        self,
        ns: str | None,
        device: str,
        rate_mbit: float,
        burst_kb: int = 32,
        latency_ms: int = 50,
    ) -> None:
        """Limit ``device`` egress with a token bucket (``tc qdisc ... tbf``)."""
        tc = ["tc", "qdisc", "replace", "dev", device, "root", "tbf"]
        tc += ["rate", f"{round(rate_mbit * 1000)}kbit", "burst", f"{burst_kb}kb"]
        tc += ["latency", f"{latency_ms}ms"]
        argv = ["ip", "netns", "exec", ns, *tc] if ns is not None else tc
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")

    def popen(self, ns: str | None, argv: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``ns`` (in its own session); :meth:`close` kills it."""
        full = ["ip", "netns", "exec", ns, *argv] if ns is not None else list(argv)
        kw.setdefault("start_new_session", True)
        process: subprocess.Popen[bytes] = subprocess.Popen(full, **kw)
        self._processes.append(process)
        return process

    def close(self) -> None:
        """Kill our processes (SIGTERM, then SIGKILL), delete links and namespaces."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for process in self._processes:
            _signal(process, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        for process in self._processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(process, signal.SIGKILL)
                process.wait()
        for process in self._processes:
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        for ns, device in self._veths:
            with contextlib.suppress(OSError):
                ip("link", "del", device, ns=ns)
        for name in reversed(self._namespaces):
            with contextlib.suppress(OSError):
                ip("netns", "del", name)


def _never_forward(ns: str | None, device: str) -> None:
    """Turn IPv4 forwarding off for packets arriving on ``device``, whatever the host's
    ``ip_forward`` (a Docker host has it on in the root namespace)."""
    setting = f"/proc/sys/net/ipv4/conf/{device}/forwarding"
    argv = ["sh", "-c", f"echo 0 > {setting}"]
    if ns is not None:
        argv = ["ip", "netns", "exec", ns, *argv]
    subprocess.run(argv, check=True, capture_output=True)


def _signal(process: subprocess.Popen[bytes], signum: int) -> None:
    """Signal the process group (its session) when it is not ours, else the process."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        group = os.getpgid(process.pid)
        if group != os.getpgrp():
            os.killpg(group, signum)
        else:
            process.send_signal(signum)


@pytest.fixture(name="netns_lab")
def netns_lab_fixture() -> Iterator[NetnsLab]:
    """A fresh :class:`NetnsLab`, closed after the test; skips when namespaces are unavailable."""
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with NetnsLab() as lab:
        yield lab


#: The same fixture under the name it has in tests; importing this name makes ruff report
#: F811 on every test taking ``netns_lab``, so prefer importing ``netns_lab_fixture``.
netns_lab = netns_lab_fixture
