"""Peers with no inbound route: a trainer pushes its blob to a seed for a validator to fetch,
and a private validator serves its blob through the seed's relay (loopback processes)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.support.net_children import NodeProcess, spawn_node, wait_until
from tests.support.netns import NetnsLab, netns_lab_fixture

pytestmark = pytest.mark.integration
__all__ = ["netns_lab_fixture", "spawn_node"]


def connected(node: NodeProcess, peer: NodeProcess) -> Callable[[], bool]:
    return lambda: peer.peer_id in node.ask(cmd="stats")["connections"]


def test_an_outbound_only_trainer_publishes_through_a_seed(
    spawn_node: Callable[..., NodeProcess],
) -> None:
    seed = spawn_node(seed="seed")
    trainer = spawn_node(seed="trainer", host=None, roles=["trainer"], bootstrap=[seed.address])
    validator = spawn_node(seed="validator", roles=["validator"], bootstrap=[seed.address])
    assert trainer.address is None
    wait_until(connected(seed, trainer), 20, "the trainer to dial the seed")
    blob = trainer.ask(cmd="put_blob", size=3_000_000, seed=5)["blob"]
    assert trainer.ask(cmd="push", address=seed.address, blob=blob)["pushed"] is True
    # Nobody can dial the trainer; the validator fetches the blob from the seed.
    assert validator.ask(cmd="address_of", peer=trainer.peer_id)["address"] is None
    fetched = validator.ask(cmd="fetch", address=seed.address, blob=blob)
    assert fetched["verified"] and fetched["bytes"] == 3_000_000


def test_a_private_validator_serves_its_blob_through_the_seed_relay(
    spawn_node: Callable[..., NodeProcess],
) -> None:
    seed = spawn_node(seed="seed")
    validator = spawn_node(seed="validator", host=None, roles=["validator"], relay=seed.address)
    trainer = spawn_node(seed="trainer", host=None, roles=["trainer"], bootstrap=[seed.address])
    wait_until(connected(seed, validator), 20, "the private validator to keep a socket to the seed")
    wait_until(connected(seed, trainer), 20, "the trainer to dial the seed")

    def learned() -> bool:
        return trainer.ask(cmd="address_of", peer=validator.peer_id)["address"] is not None

    wait_until(learned, 20, "the trainer to learn the validator's signed peer record")
    via = trainer.ask(cmd="address_of", peer=validator.peer_id)["address"]
    assert via == f"{seed.address}/v1/relay/{validator.peer_id}"
    blob = validator.ask(cmd="put_blob", size=5_000_000, seed=9)["blob"]
    fetched = trainer.ask(cmd="fetch", peer=validator.peer_id, blob=blob)
    assert fetched["verified"] and fetched["bytes"] == 5_000_000
    assert fetched["via"] == via


@pytest.mark.netns
def test_nat_in_network_namespaces(
    spawn_node: Callable[..., NodeProcess], netns_lab: NetnsLab
) -> None:
    """A seed namespace joined to two host namespaces that cannot reach each other (no
    forwarding): the trainer host runs no server and publishes through the seed; the
    validator host runs no server either and serves its blob through the seed's relay."""
    seed_ns = netns_lab.namespace("seed")
    a_ns = netns_lab.namespace("validator")
    b_ns = netns_lab.namespace("trainer")
    seed_a, a_addr = netns_lab.link(seed_ns, a_ns, 1)
    seed_b, _ = netns_lab.link(seed_ns, b_ns, 2)
    for ns, gateway in ((a_ns, seed_a), (b_ns, seed_b)):
        subprocess.run(["ip", "-n", ns, "route", "add", "default", "via", gateway], check=True)
    seed = spawn_node(
        prefix=["ip", "netns", "exec", seed_ns],
        seed="seed",
        host="0.0.0.0",
        config={"advertise": [f"http://{seed_a}", f"http://{seed_b}"]},  # + the port it got
    )
    port = int((seed.address or "").rsplit(":", 1)[1])
    seed_urls = [f"http://{seed_a}:{port}", f"http://{seed_b}:{port}"]
    validator = spawn_node(
        prefix=["ip", "netns", "exec", a_ns],
        seed="validator",
        host=None,
        roles=["validator"],
        relay=seed_urls[0],
    )
    trainer = spawn_node(
        prefix=["ip", "netns", "exec", b_ns],
        seed="trainer",
        host=None,
        roles=["trainer"],
        bootstrap=[seed_urls[1]],
    )
    wait_until(connected(seed, validator), 30, "the validator's socket to the seed")
    wait_until(connected(seed, trainer), 30, "the trainer's socket to the seed")
    # The two hosts have no route to each other.
    probe = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            b_ns,
            sys.executable,
            "-c",
            f"import socket; socket.create_connection(('{a_addr}', 9), timeout=1)",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    # Refused would mean the packet arrived; unreachable or a timeout means no route.
    assert probe.returncode != 0
    assert "ConnectionRefused" not in probe.stderr, probe.stderr

    # The trainer publishes its update blob by pushing it to the seed.
    blob = trainer.ask(cmd="put_blob", size=2_000_000, seed=1)["blob"]
    assert trainer.ask(cmd="push", address=seed_urls[1], blob=blob)["pushed"] is True
    fetched = validator.ask(cmd="fetch", address=seed_urls[0], blob=blob)
    assert fetched["verified"]

    # The private validator's blob reaches the trainer through the seed's relay.
    def learned() -> bool:
        return trainer.ask(cmd="address_of", peer=validator.peer_id)["address"] is not None

    wait_until(learned, 30, "the trainer to learn the validator's record")
    # The seed advertises its namespace addresses with the port the kernel gave it.
    assert trainer.ask(cmd="address_of", peer=seed.peer_id)["address"] == seed_urls[0]
    mine = validator.ask(cmd="put_blob", size=3_000_000, seed=2)["blob"]
    fetched = trainer.ask(cmd="fetch", peer=validator.peer_id, blob=mine)
    assert fetched["verified"] and fetched["via"].startswith(seed_urls[0] + "/v1/relay/")
