"""The seed killed just as the trainers publish a window's updates, then started again.

The trainers of this network (a seed, a reducer, three validators with quorum 2, two
trainers) are outbound-only: they dial the seed, push their update blobs to it and gossip
their updates through it and whatever peers they found so far (early on, often the seed
alone). Early in the run, the test waits until both trainers trained their updates for a
window the network has not certified yet -- they push and publish them next -- SIGKILLs the
seed at once, and starts it again on its data directory (it comes back on its port). A
window needs both updates (``min_updates`` 2): whatever the seed took with it must be had
again -- a trainer whose update is in no proposal re-announces it, a participant asks its
peers for the updates of the open window it misses -- so the window closes, and the
restarted seed holds it, within two window deadlines of the seed being ready again. At the
end every node holds one head with the same weights.
"""

from __future__ import annotations

import pytest

from tests.support.liveness import certify, end_on_one_head, paced_net
from tests.support.local_net import Net

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

DEADLINE_S = 4.0


net = paced_net("seed-restart", validators=3, deadline_s=DEADLINE_S, max_updates=None)


def _trained_by_all(net: Net, trainers: list[str], after: int) -> int | None:
    """The lowest window above ``after`` that every trainer trained an update for."""
    windows = [{int(e["window"]) for e in net.events("trained", t)} for t in trainers]
    common = [w for w in set.intersection(*windows) if w > after]
    return min(common, default=None)


def test_a_seed_killed_as_trainers_publish_loses_no_window(net: Net) -> None:
    trainers = net.names("trainer")
    net.wait_height("seed", 1, 60)  # window 1 waits for the slow-starting trainers
    certify(net, net.names(), 1, 30, "everyone in step")

    after = net.heights["seed"]
    net.wait(
        f"both trainers to train their updates for a window above {after}",
        4 * DEADLINE_S,
        lambda: _trained_by_all(net, trainers, after) is not None,
    )
    net.kill("seed")
    window = _trained_by_all(net, trainers, after)
    assert window is not None
    net.note(
        f"seed killed once both trainers trained window {window}; heights "
        f"{dict(sorted(net.heights.items()))}"
    )

    address = net.network.nodes["seed"].address
    assert address is not None
    # started as before (--listen 127.0.0.1:0): it listens on its last port again, so the
    # peers' bootstrap address is still right
    net.start("seed", "seed", args=["--archive"])
    net.wait_ready(["seed"])
    assert net.network.nodes["seed"].address == address
    net.note(f"seed ready again at {address}")
    net.wait(
        f"window {window} to close and every node (the restarted seed too) to adopt it within "
        f"two deadlines ({2 * DEADLINE_S:.0f} s) of the seed being ready again",
        2 * DEADLINE_S,
        lambda: all(net.heights.get(n, 0) >= window for n in net.names()),
    )
    certify(net, net.names(), 1, 4 * DEADLINE_S, "the network goes on after the seed's restart")
    end_on_one_head(net, timeout_s=4 * DEADLINE_S)
