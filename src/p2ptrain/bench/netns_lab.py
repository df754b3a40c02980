"""Network namespaces for the chaos bench: one host per node, one switch, cuttable links.

:class:`NamespaceLab` gives every node its own Linux network namespace holding one end of a
veth pair; the other ends are ports of a bridge (``main``) in a namespace of the lab's own.
Every node address is in one /24 that the lab assigns (``10.<x>.0.<i>``, with ``x`` unused
in the root namespace), nothing routes out of the lab (no address or route leads to the root
namespace, no forwarding), so its traffic never leaves it.

A partition moves the cut nodes' ports to a second bridge (``cut``): the cut nodes still reach
each other, the rest still reach each other, and nothing crosses; packets in flight between
the sides are simply lost, as on a real broken link (no reset, no error). Healing moves the
ports back. Only ``ip`` (iproute2) is needed: this kernel has no netem, and there is no
iptables or nft here.

With ``link_mbit``, every host's link is shaped to that rate in both directions by a token
bucket (``tc ... tbf``) on each end of its veth pair: what the host sends leaves through its
own end, what it receives leaves the switch through its port. :meth:`NamespaceLab.
interface_bytes` reads a host's interface counters (bytes of whole frames, headers
included): what it sent and received over its link.

Everything the lab made goes in :meth:`NamespaceLab.close` (also at interpreter exit);
deleting a namespace deletes the veth ends inside it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType

__all__ = ["NamespaceLab", "free_second_octet", "ip", "namespaces_unavailable"]

_PREFIX = "p2pc"
_MAIN_BRIDGE = "main"
_CUT_BRIDGE = "cut"


def ip(*args: str, ns: str | None = None) -> str:
    """Run ``ip`` (inside ``ns`` when given); raise OSError with its stderr on failure."""
    argv = ["ip", *(("-n", ns) if ns is not None else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _tc(*args: str, ns: str) -> None:
    """Run ``tc`` inside ``ns``; raise OSError with its stderr on failure."""
    argv = ["tc", "-n", ns, *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


def namespaces_unavailable(tools: Sequence[str] = ("ip",)) -> str | None:
    """Why this process cannot build a lab with ``tools`` (iproute2's), or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{_PREFIX}probe{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except OSError as error:
        return f"cannot create a network namespace: {error}"
    with contextlib.suppress(OSError):
        ip("netns", "del", probe)
    return None


def free_second_octet() -> int:
    """A random ``x`` in 64..254 such that no address or route of the root namespace is in
    ``10.x.0.0/16``: a lab's subnets there cannot clash with the machine's."""
    text = ip("-4", "addr", "show") + ip("-4", "route", "show", "table", "all")
    used = {int(x) for x in re.findall(r"\b10\.(\d{1,3})\.", text)}
    free = sorted(set(range(64, 255)) - used)
    if not free:
        raise OSError("no free 10.x.0.0/16 left in the root namespace for a lab")
    return free[secrets.randbelow(len(free))]


class NamespaceLab:
    """A namespace per host on one bridge, and partitions between them."""

    def __init__(self, hosts: Sequence[str], *, link_mbit: float | None = None) -> None:
        self.tag = secrets.token_hex(3)[:5]  # interface names: p2pc + 5 + p + 2 <= 15
        self._closed = False
        self._namespaces: list[str] = []
        self.hosts = list(hosts)
        #: Host name -> its namespace, address, and the bridge port its link ends in.
        self.namespace: dict[str, str] = {}
        self.address: dict[str, str] = {}
        self._port: dict[str, str] = {}
        self._device: dict[str, str] = {}
        self.cut_off: tuple[str, ...] = ()
        self.link_mbit = link_mbit
        atexit.register(self.close)
        try:
            self._build(free_second_octet())
            if link_mbit is not None:
                for host in self.hosts:
                    self._shape(host, link_mbit)
        except BaseException:
            self.close()
            raise

    def _new_namespace(self, label: str) -> str:
        name = f"{_PREFIX}{self.tag}-{label}"
        ip("netns", "add", name)
        self._namespaces.append(name)
        ip("link", "set", "lo", "up", ns=name)
        return name

    def _build(self, second_octet: int) -> None:
        switch = self._new_namespace("switch")
        for bridge in (_MAIN_BRIDGE, _CUT_BRIDGE):
            ip("link", "add", bridge, "type", "bridge", ns=switch)
            ip("link", "set", bridge, "up", ns=switch)
        self._switch = switch
        for index, host in enumerate(self.hosts, start=1):
            ns = self._new_namespace(f"h{index}")
            device, port = f"{_PREFIX}{self.tag}h{index}", f"{_PREFIX}{self.tag}p{index}"
            ip("link", "add", device, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", switch)  # fmt: skip
            address = f"10.{second_octet}.0.{index}"
            ip("addr", "add", f"{address}/24", "dev", device, ns=ns)
            ip("link", "set", device, "up", ns=ns)
            ip("link", "set", port, "master", _MAIN_BRIDGE, ns=switch)
            ip("link", "set", port, "up", ns=switch)
            self.namespace[host], self.address[host], self._port[host] = ns, address, port
            self._device[host] = device

    def _shape(self, host: str, mbit: float) -> None:
        """A token bucket of ``mbit`` on both ends of ``host``'s link. The bucket holds
        256 KiB (a segmentation-offloaded packet on a veth can be 64 KiB; a smaller bucket
        would drop it), and a packet waits at most 200 ms for tokens."""
        rate = f"{mbit * 1000:.0f}kbit"
        for device, ns in ((self._device[host], self.namespace[host]),
                           (self._port[host], self._switch)):  # fmt: skip
            _tc("qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", "256kb",
                "latency", "200ms", ns=ns)  # fmt: skip

    def host_address(self, host: str) -> str:
        return self.address[host]

    def interface_bytes(self, host: str) -> tuple[int, int]:
        """(sent, received) bytes of ``host``'s interface so far, frames with headers."""
        text = ip("-s", "-j", "link", "show", "dev", self._device[host], ns=self.namespace[host])
        try:
            stats = json.loads(text)[0]["stats64"]
            return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])
        except (ValueError, KeyError, IndexError) as exc:
            raise OSError(f"cannot read {host}'s interface counters from {text[:200]!r}") from exc

    def command_prefix(self, host: str) -> list[str]:
        """What runs a program inside ``host``'s namespace (``ip netns exec`` execs the
        program itself, so its pid is the program's)."""
        return ["ip", "netns", "exec", self.namespace[host]]

    def cut(self, hosts: Sequence[str]) -> None:
        """Partition ``hosts`` from the others (heal first if a partition is on)."""
        self.heal()
        for host in hosts:
            ip("link", "set", self._port[host], "master", _CUT_BRIDGE, ns=self._switch)
        self.cut_off = tuple(hosts)

    def heal(self) -> None:
        for host in self.cut_off:
            ip("link", "set", self._port[host], "master", _MAIN_BRIDGE, ns=self._switch)
        self.cut_off = ()

    def close(self) -> None:
        """Delete every namespace the lab made (run the processes inside them down first)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for name in reversed(self._namespaces):
            with contextlib.suppress(OSError):
                ip("netns", "del", name)

    def __enter__(self) -> NamespaceLab:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
