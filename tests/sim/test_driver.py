"""The simulator runs the node's own driver: its runner carries out every effect, and its
peer services choose, race and blame blob providers over the virtual network.

One seeded scenario: a validator crashes and comes back (it fetches the heads it missed),
one provider is on a slow link (2 kB/s) and one (``x-lying_provider``, a reducer) serves
every blob with a byte flipped. The nodes fetch aggregates and states from the providers
the driver names; the liar is asked first (it proposed), proven bad by the hash and
blamed by its peer record in the asking node's own :class:`PeerServices`; the slow one is
raced past after a hedge interval. A simulator that carried out effects itself instead of
the runner, or fetched without the services, fails this test.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from p2ptrain.core.encoding import sha256_hex
from p2ptrain.driver.runner import RoleRunner
from p2ptrain.sim.scenario import Crash, Scenario, SlowLink
from p2ptrain.sim.world import World

SEED = 42
LIAR = "x-lying_provider"
SLOW = "v0"


def _scenario() -> Scenario:
    return Scenario(
        trainers=10,
        validators=3,
        quorum=2,
        windows=4,
        seed=SEED,
        adversaries=("lying_provider",),
        crashes=(Crash("v2", 8.0, 70.0),),
        slow=(SlowLink(SLOW, 2_000.0, 0.5),),
    )


@pytest.fixture(scope="module")
def run() -> tuple[World, Counter[str]]:
    """The scenario, run once, with every effect the runners carried out counted."""
    done: Counter[str] = Counter()
    do = RoleRunner.do

    def counting(self: RoleRunner, effect: Any) -> None:
        done[type(effect).__name__] += 1
        do(self, effect)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RoleRunner, "do", counting)
        world = World(_scenario())
        world.run()
    return world, done


def test_the_network_certifies_with_a_liar_and_a_slow_provider(
    run: tuple[World, Counter[str]],
) -> None:
    world, done = run
    print(f"seed {SEED}: effects {dict(done)}")
    assert world.role_failures == []
    assert world.observer.violations == []
    assert sorted(world.observer.certified) == [1, 2, 3, 4]
    # every effect went through the node's runner, fetches included
    assert done["Publish"] > 0 and done["Fetch"] > 0 and done["Adopted"] > 0
    assert done["StoreRecord"] > 0 and done["KeepState"] > 0


def test_the_services_blame_the_liar_by_its_peer_record(run: tuple[World, Counter[str]]) -> None:
    world, _ = run
    liar = world.nodes[LIAR].identity.peer_id
    blamed = {
        name: [r.reason for r in node.runner.services.reports if r.peer == liar]
        for name, node in world.nodes.items()
        if node.runner is not None
    }
    print(f"seed {SEED}: blamed by {sorted(n for n, reasons in blamed.items() if reasons)}")
    asked_the_liar = [
        name
        for name, node in world.nodes.items()
        if node.transport is not None
        and any(LIAR in asked for _, asked, _ in node.transport.downloads)
    ]
    assert asked_the_liar
    for name in asked_the_liar:
        assert any("served a bad blob" in reason for reason in blamed[name]), (name, blamed[name])
    honest = {n for n, node in world.nodes.items() if node.behaviour == "honest"}
    assert not any(r.peer != liar for n in honest for r in world.nodes[n].runner.services.reports)
    assert world.observer.reports["served a bad blob"] >= len(asked_the_liar)


def test_a_slow_provider_is_raced_past_and_nobody_keeps_bad_bytes(
    run: tuple[World, Counter[str]],
) -> None:
    world, _ = run
    raced = [
        (name, blob_id[:12], asked, winner)
        for name, node in world.nodes.items()
        if node.transport is not None
        for blob_id, asked, winner in node.transport.downloads
        if SLOW in asked[:-1] and winner not in (None, SLOW, LIAR)
    ]
    print(f"seed {SEED}: raced past the slow provider: {raced}")
    assert raced, "no download raced past the slow provider"
    for node in world.nodes.values():
        for blob_id, blob in node.keep.blobs.data.items():
            assert sha256_hex(blob) == blob_id, node.name
