"""Peers with no inbound route: a trainer pushes its blob to a seed for a validator to fetch,
and a private validator serves its blob through the seed's relay (loopback processes)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support.net_children import NodeProcess, spawn_node, wait_until

pytestmark = pytest.mark.integration
__all__ = ["spawn_node"]


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
