"""Which address and interface of this machine a cluster member uses."""

from __future__ import annotations

import contextlib
import ipaddress
import socket

import ifaddr

__all__ = ["interface_holding", "lan_address"]

_MDNS_GROUP = ("224.0.0.251", 5353)


def _addresses() -> list[tuple[str, ipaddress.IPv4Address]]:
    return [
        (adapter.name, ipaddress.IPv4Address(ip.ip))
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if isinstance(ip.ip, str)
    ]


def lan_address() -> str:
    """The IPv4 address this machine sends the LAN's multicast from (where mDNS goes);
    else its first address that is not loopback; else 127.0.0.1."""
    with (
        contextlib.suppress(OSError),
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe,
    ):
        probe.connect(_MDNS_GROUP)  # picks a route; sends nothing
        chosen = str(probe.getsockname()[0])
        if chosen != "0.0.0.0":
            return chosen
    others = [address for _, address in _addresses() if not address.is_loopback]
    return str(others[0]) if others else "127.0.0.1"


def interface_holding(address: str) -> str | None:
    """The name of the interface that holds ``address`` (None: no interface does)."""
    wanted = ipaddress.IPv4Address(address)
    return next((name for name, held in _addresses() if held == wanted), None)
