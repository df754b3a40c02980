"""Zero-configuration LAN: two nodes with mDNS on, in two namespaces joined by a veth and no
bootstrap, find each other and open a gossip connection."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support.net_children import NodeProcess, spawn_node, wait_until
from tests.support.netns import NetnsLab, netns_lab_fixture

pytestmark = [pytest.mark.integration, pytest.mark.netns]
__all__ = ["netns_lab_fixture", "spawn_node"]


def test_two_nodes_find_each_other_by_mdns(
    spawn_node: Callable[..., NodeProcess], netns_lab: NetnsLab
) -> None:
    left, right = netns_lab.namespace("left"), netns_lab.namespace("right")
    netns_lab.link(left, right, 1)
    nodes = [
        spawn_node(
            prefix=["ip", "netns", "exec", ns],
            seed=f"lan-{ns[-5:]}",
            host="0.0.0.0",
            config={"mdns": True},
        )
        for ns in (left, right)
    ]

    def linked() -> bool:
        return all(
            other.peer_id in node.ask(cmd="stats")["connections"]
            for node, other in (nodes, nodes[::-1])
        )

    wait_until(linked, 30, "the two LAN nodes to connect through mDNS")
