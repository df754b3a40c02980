"""Opt-in LAN discovery through mDNS / DNS-SD (zeroconf).

A node with a server announces ``<peer_id[:16]>._p2ptrain._tcp.local.`` with the TXT record
``net=<network_id> peer=<peer_id> v=1`` (plus ``tls=1`` for a TLS server); every node browses
for that type. A found peer is an untrusted hint: the caller fetches the peer's signed record
from the address before believing anything about it.

:func:`parse_lan_peer` is the pure part (a resolved service in, a :class:`LanPeer` or
:class:`~p2ptrain.errors.ProtocolViolation` out); :class:`LanDiscovery` is the zeroconf shell.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ifaddr
from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from p2ptrain.errors import LocalError, ProtocolViolation

SERVICE_TYPE = "_p2ptrain._tcp.local."
TXT_VERSION = "1"
RESOLVE_TIMEOUT_MS = 3000
MAX_RESOLVING = 64  # resolutions in flight; a LAN flooding us with names gets the rest ignored

log = logging.getLogger(__name__)
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class LanPeer:
    """A peer announced on the LAN; only a hint until its signed record is fetched."""

    peer_id: str
    network_id: str
    address: str  # "http://IP:PORT", or https when the TXT says tls=1


@dataclass(frozen=True, slots=True)
class LanDiscoveryStatistics:
    announced: bool  # our service is registered now
    peers_found: int  # distinct peer ids of our network reported so far
    records_ignored: int  # malformed or other-network records, resolutions over MAX_RESOLVING


def txt_properties(*, network_id: str, peer_id: str, tls: bool) -> dict[str, str]:
    """The TXT record we announce."""
    return {"net": network_id, "peer": peer_id, "v": TXT_VERSION} | ({"tls": "1"} if tls else {})


def _txt(properties: Mapping[bytes, bytes | None], key: str) -> str | None:
    value = properties.get(key.encode())
    try:
        return None if value is None else value.decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolViolation(f"TXT {key} is not ASCII") from None


def _unicast_ipv4(text: str) -> ipaddress.IPv4Address | None:
    try:
        address = ipaddress.IPv4Address(text)
    except ValueError:
        return None
    return None if address.is_multicast or address.is_unspecified else address


def pick_address(addresses: Sequence[str], local_networks: Sequence[ipaddress.IPv4Network]) -> str:
    """The announced IPv4 address we most likely reach: on one of our subnets, not loopback,
    earliest announced. ProtocolViolation when none is a unicast IPv4 address."""
    ranked = []
    for index, text in enumerate(addresses):
        if (address := _unicast_ipv4(text)) is not None:
            off_link = not any(address in network for network in local_networks)
            ranked.append((off_link, address.is_loopback, index, str(address)))
    if not ranked:
        raise ProtocolViolation(f"no unicast IPv4 address announced in {list(addresses)!r:.200}")
    return min(ranked)[3]


def parse_lan_peer(
    properties: Mapping[bytes, bytes | None],
    port: int | None,
    addresses: Sequence[str],
    local_networks: Sequence[ipaddress.IPv4Network] = (),
) -> LanPeer:
    """A LanPeer from a resolved service, or ProtocolViolation for anything malformed."""
    if _txt(properties, "v") != TXT_VERSION:
        raise ProtocolViolation(f"TXT v must be {TXT_VERSION!r}")
    network_id, peer_id = (_txt(properties, key) for key in ("net", "peer"))
    for key, value in (("net", network_id), ("peer", peer_id)):
        if value is None or not _HEX64.fullmatch(value):
            raise ProtocolViolation(f"TXT {key} must be 64 lowercase hex characters")
    assert network_id is not None and peer_id is not None  # for mypy: checked just above
    if (tls := _txt(properties, "tls")) not in (None, "0", "1"):
        raise ProtocolViolation("TXT tls must be 0 or 1")
    if port is None or not 0 < port <= 65535:
        raise ProtocolViolation(f"service port {port!r} is not 1-65535")
    host = pick_address(addresses, local_networks)
    scheme = "https" if tls == "1" else "http"
    return LanPeer(peer_id=peer_id, network_id=network_id, address=f"{scheme}://{host}:{port}")


def _local_interfaces() -> list[ipaddress.IPv4Interface]:
    return [
        ipaddress.IPv4Interface(f"{ip.ip}/{ip.network_prefix}")
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if isinstance(ip.ip, str)
    ]


class LanDiscovery:
    """Announce this node on the LAN (when ``port`` > 0) and report peers of our network.

    ``interfaces``: IPv4 addresses of the local interfaces zeroconf uses (None: all).
    ``addresses``: IPv4 addresses we announce (empty: those of the interfaces, loopback only
    when there is nothing else). ``on_found`` runs on the event loop once per (peer id,
    address) change; what it raises is logged.
    """

    def __init__(
        self,
        *,
        network_id: str,
        peer_id: str,
        port: int,
        addresses: Sequence[str] = (),
        interfaces: Sequence[str] | None = None,
        tls: bool = False,
        on_found: Callable[[LanPeer], None],
    ) -> None:
        for field, value in (("network_id", network_id), ("peer_id", peer_id)):
            if not _HEX64.fullmatch(value):
                raise LocalError(
                    f"LAN discovery {field} must be 64 lowercase hex characters (a SHA-256), "
                    f"got {value!r:.80}; pass the node's own id, not a name"
                )
        if not 0 <= port <= 65535:
            raise LocalError(f"LAN discovery port must be 0 (browse only) or 1-65535, got {port}")
        if interfaces is not None and not interfaces:
            raise LocalError("LAN discovery interfaces is empty; give None to use them all")
        for field, values in (("addresses", addresses), ("interfaces", interfaces or ())):
            for value in values:
                if _unicast_ipv4(value) is None:
                    raise LocalError(
                        f"LAN discovery {field} must be unicast IPv4 addresses of this machine's "
                        f"interfaces (for example 192.168.1.10), got {value!r:.80}"
                    )
        self._network_id, self._peer_id, self._port, self._tls = network_id, peer_id, port, tls
        self._addresses = list(addresses)
        self._interfaces = None if interfaces is None else list(interfaces)
        self._on_found = on_found
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._announcing: asyncio.Future[Any] | None = None
        self._tasks: dict[str, asyncio.Future[Any]] = {}  # service name -> resolution
        self._names: dict[str, str] = {}  # service name -> peer id
        self._reported: dict[str, str] = {}  # peer id -> address last reported
        self._found: set[str] = set()
        self._announced = False
        self._ignored = 0

    def statistics(self) -> LanDiscoveryStatistics:
        return LanDiscoveryStatistics(self._announced, len(self._found), self._ignored)

    def _announced_addresses(self) -> list[str]:
        if self._addresses:
            return self._addresses
        if self._interfaces is not None:
            local = [ipaddress.IPv4Address(a) for a in self._interfaces]
        else:
            local = [interface.ip for interface in _local_interfaces()]
        return [str(a) for a in local if not a.is_loopback] or [str(a) for a in local]

    async def start(self) -> None:
        """Open the mDNS sockets, announce our service (port > 0) and start browsing."""
        if self._zc is not None:
            raise LocalError("LAN discovery is already started; stop it before starting again")
        try:
            self._zc = AsyncZeroconf(
                interfaces=InterfaceChoice.All if self._interfaces is None else self._interfaces,
                ip_version=IPVersion.V4Only,
            )
            if self._port > 0:
                info = AsyncServiceInfo(
                    SERVICE_TYPE,
                    f"{self._peer_id[:16]}.{SERVICE_TYPE}",
                    port=self._port,
                    properties=txt_properties(
                        network_id=self._network_id, peer_id=self._peer_id, tls=self._tls
                    ),
                    server=f"p2ptrain-{self._peer_id[:16]}.local.",
                    parsed_addresses=self._announced_addresses(),
                )
                announcing = await self._zc.async_register_service(info, allow_name_change=True)
                self._announcing = asyncio.ensure_future(announcing)
                self._announced = True
            self._browser = AsyncServiceBrowser(
                self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_service_state_change]
            )
        except BaseException as error:
            await self.stop()
            if isinstance(error, OSError | RuntimeError):  # zeroconf's "no interfaces"
                raise LocalError(
                    f"LAN discovery could not open its mDNS sockets ({error}); check the "
                    "interface addresses or turn LAN discovery off"
                ) from error
            raise

    async def stop(self) -> None:
        """Stop browsing, send goodbyes for our service and close the sockets; idempotent."""
        zc, browser = self._zc, self._browser
        self._zc, self._browser = None, None
        if browser is not None:
            await browser.async_cancel()  # first, so no callback starts another resolution
        tasks = list(self._tasks.values())
        if self._announcing is not None:
            tasks.append(self._announcing)
        self._tasks.clear()
        self._announcing = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if zc is not None:
            await zc.async_close()
        self._announced = False
        self._names.clear()
        self._reported.clear()

    def _on_service_state_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        """Browser callback, on the event loop; never raises."""
        if (previous := self._tasks.pop(name, None)) is not None:
            previous.cancel()
        if state_change is ServiceStateChange.Removed:
            peer_id = self._names.pop(name, None)
            if peer_id is not None and peer_id not in self._names.values():
                self._reported.pop(peer_id, None)
        elif len(self._tasks) >= MAX_RESOLVING:
            self._ignored += 1
        else:
            task = asyncio.ensure_future(self._resolve(zeroconf, name))
            self._tasks[name] = task
            task.add_done_callback(lambda done: self._resolved(name, done))

    def _resolved(self, name: str, task: asyncio.Future[Any]) -> None:
        if self._tasks.get(name) is task:
            del self._tasks[name]
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("LAN discovery: resolving %s failed", name, exc_info=error)

    async def _resolve(self, zeroconf: Zeroconf, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(zeroconf, RESOLVE_TIMEOUT_MS):
            log.debug("LAN discovery: %s did not resolve in %d ms", name, RESOLVE_TIMEOUT_MS)
            return
        networks = [interface.network for interface in _local_interfaces()]
        addresses = info.parsed_addresses(IPVersion.V4Only)
        try:
            peer = parse_lan_peer(info.properties, info.port, addresses, networks)
        except ProtocolViolation as error:
            self._ignored += 1
            log.debug("LAN discovery: ignoring %s: %s", name, error)
            return
        if peer.peer_id == self._peer_id:
            return
        if peer.network_id != self._network_id:
            self._ignored += 1
            return
        self._names[name] = peer.peer_id
        if self._reported.get(peer.peer_id) == peer.address:
            return
        self._reported[peer.peer_id] = peer.address
        self._found.add(peer.peer_id)
        try:
            self._on_found(peer)
        except Exception:
            log.exception("LAN discovery: on_found failed for %s", peer)
