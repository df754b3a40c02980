"""LAN discovery without a network: argument checks, TXT parsing, address choice, and what
the browser callback reports for resolved services (zeroconf's resolver replaced by a table).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from zeroconf import IPVersion, ServiceInfo, ServiceStateChange

from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.net import mdns
from p2ptrain.net.mdns import (
    SERVICE_TYPE,
    LanDiscovery,
    LanDiscoveryStatistics,
    LanPeer,
    parse_lan_peer,
    pick_address,
    txt_properties,
)
from tests.support.builders import h

NET = h("network")
OTHER_NET = h("other network")
ME, ALICE, BOB = h("me"), h("alice"), h("bob")
LAN = ipaddress.IPv4Network("192.168.1.0/24")
LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")


def txt(**properties: str | None) -> dict[bytes, bytes | None]:
    """Properties as zeroconf hands them over: decoded from the wire TXT bytes."""
    wire = ServiceInfo(SERVICE_TYPE, f"x.{SERVICE_TYPE}", properties=properties).text
    return ServiceInfo(SERVICE_TYPE, f"x.{SERVICE_TYPE}", properties=wire).properties


def announced(network_id: str = NET, peer_id: str = ALICE, tls: bool = False) -> dict[bytes, Any]:
    return txt(**txt_properties(network_id=network_id, peer_id=peer_id, tls=tls))


def discovery(**overrides: Any) -> LanDiscovery:
    arguments: dict[str, Any] = {
        "network_id": NET,
        "peer_id": ME,
        "port": 8000,
        "on_found": lambda peer: None,
    }
    return LanDiscovery(**(arguments | overrides))


# -- arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"peer_id": ME.upper()}, "peer_id must be 64 lowercase hex"),
        ({"peer_id": ME[:63]}, "peer_id must be 64 lowercase hex"),
        ({"network_id": "mynet"}, "network_id must be 64 lowercase hex"),
        ({"port": -1}, "port must be 0 (browse only) or 1-65535"),
        ({"port": 65536}, "port must be 0 (browse only) or 1-65535"),
        ({"addresses": ["example.org"]}, "addresses must be unicast IPv4"),
        ({"addresses": ["224.0.0.251"]}, "addresses must be unicast IPv4"),
        ({"addresses": ["0.0.0.0"]}, "addresses must be unicast IPv4"),
        ({"addresses": ["::1"]}, "addresses must be unicast IPv4"),
        ({"interfaces": ["eth0"]}, "interfaces must be unicast IPv4"),
        ({"interfaces": []}, "give None to use them all"),
    ],
)
def test_bad_arguments_are_local_errors_saying_what_to_do(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(LocalError, match=message.replace("(", r"\(").replace(")", r"\)")):
        discovery(**overrides)


def test_good_arguments_and_fresh_statistics() -> None:
    for port in (0, 1, 65535):
        d = discovery(port=port, addresses=["192.168.1.10"], interfaces=["192.168.1.10"])
        assert d.statistics() == LanDiscoveryStatistics(False, 0, 0)


def test_stop_without_start_is_idempotent() -> None:
    async def scenario() -> None:
        d = discovery()
        await d.stop()
        await d.stop()

    asyncio.run(scenario())


# -- TXT parsing -------------------------------------------------------------------------


def test_our_txt_record_round_trips_through_the_wire_format() -> None:
    peer = parse_lan_peer(announced(), 8000, ["192.168.1.20"])
    assert peer == LanPeer(peer_id=ALICE, network_id=NET, address="http://192.168.1.20:8000")
    peer = parse_lan_peer(announced(tls=True), 443, ["192.168.1.20"])
    assert peer.address == "https://192.168.1.20:443"
    assert parse_lan_peer(txt(**{"net": NET, "peer": ALICE, "v": "1", "tls": "0"}), 1, ["10.0.0.1"])


@pytest.mark.parametrize(
    ("properties", "port", "addresses", "problem"),
    [
        (txt(net=NET, peer=ALICE), 8000, ["192.168.1.20"], "TXT v must be '1'"),
        (txt(net=NET, peer=ALICE, v="2"), 8000, ["192.168.1.20"], "TXT v must be '1'"),
        (txt(net=NET, peer=ALICE, v=None), 8000, ["192.168.1.20"], "TXT v must be '1'"),
        (txt(peer=ALICE, v="1"), 8000, ["192.168.1.20"], "TXT net must be 64"),
        (txt(net=NET.upper(), peer=ALICE, v="1"), 8000, ["192.168.1.20"], "TXT net must be 64"),
        (txt(net=NET, peer=ALICE[:-1], v="1"), 8000, ["192.168.1.20"], "TXT peer must be 64"),
        (txt(net=NET, peer=None, v="1"), 8000, ["192.168.1.20"], "TXT peer must be 64"),
        ({b"v": b"1", b"net": NET.encode(), b"peer": b"\xff" * 64}, 8000, [], "not ASCII"),
        (announced() | {b"tls": b"yes"}, 8000, ["192.168.1.20"], "TXT tls must be 0 or 1"),
        (announced(), None, ["192.168.1.20"], "port None is not 1-65535"),
        (announced(), 0, ["192.168.1.20"], "port 0 is not 1-65535"),
        (announced(), 65536, ["192.168.1.20"], "port 65536 is not 1-65535"),
        (announced(), 8000, [], "no unicast IPv4 address"),
        (announced(), 8000, ["224.0.0.251", "0.0.0.0", "fe80::1", "x"], "no unicast IPv4"),
    ],
)
def test_malformed_records_are_protocol_violations(
    properties: dict[bytes, bytes | None], port: int | None, addresses: list[str], problem: str
) -> None:
    with pytest.raises(ProtocolViolation) as raised:
        parse_lan_peer(properties, port, addresses)
    assert problem in str(raised.value)


TXT_KEYS = st.sampled_from([b"v", b"net", b"peer", b"tls"]) | st.binary(max_size=6)
TXT_VALUES = (
    st.none()
    | st.sampled_from([b"0", b"1", b"2", NET.encode(), ALICE.encode(), ALICE.upper().encode()])
    | st.binary(max_size=70)
)
ADDRESSES = st.sampled_from(["192.168.1.20", "127.0.0.1", "224.0.0.1", "0.0.0.0", "::1"])


@given(
    properties=st.dictionaries(TXT_KEYS, TXT_VALUES, max_size=6),
    port=st.none() | st.integers(-5, 70_000),
    addresses=st.lists(ADDRESSES | st.text(max_size=20), max_size=4),
)
def test_any_record_parses_or_is_a_protocol_violation(
    properties: dict[bytes, bytes | None], port: int | None, addresses: list[str]
) -> None:
    try:
        peer = parse_lan_peer(properties, port, addresses, [LAN])
    except ProtocolViolation:
        return
    assert properties[b"v"] == b"1" and peer.peer_id.encode() == properties[b"peer"]
    scheme, host, parsed_port = peer.address.replace("//", "").split(":")
    assert scheme == ("https" if properties.get(b"tls") == b"1" else "http")
    assert host in addresses and int(parsed_port) == port


# -- address choice ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("addresses", "local", "expected"),
    [
        (["10.9.9.9", "192.168.1.20"], [LAN], "192.168.1.20"),  # on our subnet wins
        (
            ["127.0.0.1", "192.168.1.20"],
            [LAN, LOOPBACK],
            "192.168.1.20",
        ),
        (["127.0.0.1", "172.17.0.1"], [], "172.17.0.1"),  # loopback only as a last resort
        (["10.9.9.9", "172.17.0.1"], [], "10.9.9.9"),  # else the earliest announced
        (["garbage", "224.0.0.1", "10.9.9.9"], [LAN], "10.9.9.9"),
        (["127.0.0.1"], [LAN], "127.0.0.1"),
    ],
)
def test_pick_address(
    addresses: list[str], local: list[ipaddress.IPv4Network], expected: str
) -> None:
    assert pick_address(addresses, local) == expected


# -- what the browser callback reports ---------------------------------------------------


@dataclass
class Resolver:
    """Stands in for zeroconf's AsyncServiceInfo: resolves names from ``records``."""

    records: dict[str, tuple[dict[bytes, bytes | None], int, list[str]]] = field(
        default_factory=dict
    )
    hold: asyncio.Event | None = None  # when set, resolutions wait for this event

    def info_class(self) -> Callable[[str, str], Any]:
        resolver = self

        class FakeInfo:
            def __init__(self, type_: str, name: str) -> None:
                self.name = name

            async def async_request(self, zc: object, timeout: float) -> bool:
                if resolver.hold is not None:
                    await resolver.hold.wait()
                record = resolver.records.get(self.name)
                if record is not None:
                    self.properties, self.port, self.addresses = record
                return record is not None

            def parsed_addresses(self, version: IPVersion) -> list[str]:
                assert version is IPVersion.V4Only
                return self.addresses

        return FakeInfo


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> Resolver:
    resolver = Resolver()
    monkeypatch.setattr(mdns, "AsyncServiceInfo", resolver.info_class())
    local = [ipaddress.IPv4Interface("192.168.1.10/24")]
    monkeypatch.setattr(mdns, "_local_interfaces", lambda: local)
    return resolver


def announce(d: LanDiscovery, name: str, change: ServiceStateChange) -> None:
    """Fire the browser callback as zeroconf does."""
    d._on_service_state_change(
        zeroconf=None,  # type: ignore[arg-type]
        service_type=SERVICE_TYPE,
        name=name,
        state_change=change,
    )


async def browse(d: LanDiscovery, name: str, change: ServiceStateChange) -> None:
    """Fire the browser callback and let the resolution it starts finish."""
    announce(d, name, change)
    await asyncio.wait_for(asyncio.gather(*d._tasks.values(), return_exceptions=True), 5)


def test_reports_each_peer_once_per_address_and_ignores_others(resolver: Resolver) -> None:
    added, updated, removed = (
        ServiceStateChange.Added,
        ServiceStateChange.Updated,
        ServiceStateChange.Removed,
    )
    found: list[LanPeer] = []
    d = discovery(on_found=found.append)
    resolver.records = {
        "me": (announced(peer_id=ME), 8000, ["192.168.1.10"]),
        "alice": (announced(), 8001, ["10.9.9.9", "192.168.1.20"]),
        "other": (announced(network_id=OTHER_NET, peer_id=BOB), 8002, ["192.168.1.30"]),
        "bad": (announced(peer_id=BOB) | {b"v": b"2"}, 8002, ["192.168.1.30"]),
    }
    alice = LanPeer(peer_id=ALICE, network_id=NET, address="http://192.168.1.20:8001")

    async def scenario() -> None:
        for name in ("me", "alice", "other", "bad", "silent"):
            await browse(d, name, added)
        assert found == [alice]
        assert d.statistics() == LanDiscoveryStatistics(False, 1, 2)
        await browse(d, "alice", updated)
        assert found == [alice]  # same address: not again
        resolver.records["alice"] = (announced(tls=True), 8443, ["192.168.1.21"])
        await browse(d, "alice", updated)
        moved = LanPeer(peer_id=ALICE, network_id=NET, address="https://192.168.1.21:8443")
        assert found == [alice, moved]
        await browse(d, "alice", removed)
        await browse(d, "alice", added)  # gone and back: reported again
        assert found == [alice, moved, moved]
        assert d.statistics() == LanDiscoveryStatistics(False, 1, 2)

    asyncio.run(scenario())


def test_a_failing_on_found_is_logged_not_raised(
    resolver: Resolver, caplog: pytest.LogCaptureFixture
) -> None:
    def on_found(peer: LanPeer) -> None:
        raise RuntimeError("caller bug")

    d = discovery(on_found=on_found)
    resolver.records["alice"] = (announced(), 8001, ["192.168.1.20"])
    with caplog.at_level(logging.ERROR, logger=mdns.__name__):
        asyncio.run(browse(d, "alice", ServiceStateChange.Added))
    assert "on_found failed" in caplog.text and "caller bug" in caplog.text
    assert d.statistics().peers_found == 1


def test_resolutions_in_flight_are_capped_and_cancelled_by_stop(resolver: Resolver) -> None:
    async def scenario() -> None:
        resolver.hold = asyncio.Event()
        d = discovery()
        for i in range(mdns.MAX_RESOLVING + 3):
            announce(d, f"peer{i}.{SERVICE_TYPE}", ServiceStateChange.Added)
        tasks = list(d._tasks.values())
        assert len(tasks) == mdns.MAX_RESOLVING
        assert d.statistics().records_ignored == 3
        announce(d, f"peer0.{SERVICE_TYPE}", ServiceStateChange.Removed)  # cancels its resolution
        await asyncio.wait_for(asyncio.gather(tasks[0], return_exceptions=True), 5)
        assert tasks[0].cancelled() and len(d._tasks) == mdns.MAX_RESOLVING - 1
        await asyncio.wait_for(d.stop(), 5)
        assert not d._tasks and all(task.cancelled() for task in tasks)

    asyncio.run(scenario())
