"""Eight node processes gossip over loopback: exactly-once delivery, and a killed node does
not stall the others."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support.net_children import NodeProcess, spawn_node, wait_until

pytestmark = pytest.mark.integration
__all__ = ["spawn_node"]

NODES = 8
MESSAGES = 1000


def start_mesh(spawn: Callable[..., NodeProcess], count: int) -> list[NodeProcess]:
    seed = spawn(seed="n0")
    nodes = [seed] + [spawn(seed=f"n{i}", bootstrap=[seed.address]) for i in range(1, count)]
    stats: dict[str, list[str]] = {}

    def formed() -> bool:
        for node in nodes:
            stats[node.peer_id] = node.ask(cmd="stats")["connections"]
        return all(len(peers) >= 3 for peers in stats.values())

    wait_until(formed, 60, f"a mesh of {count} nodes with 3 connections each")
    return nodes


def delivered_counts(nodes: list[NodeProcess]) -> list[dict[str, object]]:
    return [node.ask(cmd="stats") for node in nodes]


def test_every_message_reaches_every_node_exactly_once(
    spawn_node: Callable[..., NodeProcess],
) -> None:
    nodes = start_mesh(spawn_node, NODES)
    for node in nodes:
        node.ask(cmd="publish", count=MESSAGES, timeout=60)
    expected = NODES - 1

    def all_delivered() -> bool:
        return all(
            sum(s["delivered"].values()) >= expected * MESSAGES  # type: ignore[union-attr]
            for s in delivered_counts(nodes)
        )

    wait_until(all_delivered, 120, f"{expected * MESSAGES} messages at every node")
    for node, stats in zip(nodes, delivered_counts(nodes), strict=True):
        delivered = stats["delivered"]
        assert isinstance(delivered, dict)
        assert stats["repeats"] == 0, stats
        assert node.peer_id not in delivered
        assert sorted(delivered.values()) == [MESSAGES] * expected, stats
    # Discovery ran all along: connections are added, but not dialed again and closed as
    # duplicates round after round (a simultaneous dial may cost one or two).
    closed = [s["opened"] - len(s["connections"]) for s in delivered_counts(nodes)]
    assert max(closed) <= 3, closed


def test_a_node_killed_with_sigkill_does_not_stall_the_others(
    spawn_node: Callable[..., NodeProcess],
) -> None:
    nodes = start_mesh(spawn_node, NODES)
    victim, survivors = nodes[3], nodes[:3] + nodes[4:]
    victim.ask(cmd="publish", count=200, tag="before")
    victim.kill()
    for node in survivors:
        node.ask(cmd="publish", count=MESSAGES, tag="after", timeout=60)
    others = len(survivors) - 1

    def survivors_delivered() -> bool:
        for stats in delivered_counts(survivors):
            delivered = stats["delivered"]
            assert isinstance(delivered, dict)
            if sum(n for p, n in delivered.items() if p != victim.peer_id) < others * MESSAGES:
                return False
        return True

    wait_until(survivors_delivered, 120, "every survivor's messages at every survivor")
    for stats in delivered_counts(survivors):
        assert stats["repeats"] == 0, stats
        delivered = stats["delivered"]
        assert isinstance(delivered, dict)
        assert delivered.get(victim.peer_id, 0) <= 200
        assert sorted(n for p, n in delivered.items() if p != victim.peer_id) == [MESSAGES] * others
