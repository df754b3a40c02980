"""A validator paused twice, each time for longer than the WebSocket heartbeat, is neither
struck nor banned, and is back at the network's height soon after each pause.

Every node of this network (a seed, a reducer, three validators with quorum 2, two
trainers) runs with ``--heartbeat-s`` :data:`HEARTBEAT_S`. A validator chosen at random is
paused (SIGSTOP) twice for about three heartbeats: its peers' sockets to it die of
heartbeat timeouts, which is the network's fault, not the validator's, so no node may count
a strike against it (three would ban it; one is already a failure here) nor ban it. The
network goes on meanwhile (two validators make a quorum), and each time it is continued the
validator is back at the height the network had then within :data:`CATCH_UP_S`. At the end
every node holds one head with the same weights.
"""

from __future__ import annotations

import pytest

from tests.support.liveness import (
    accusations,
    certify,
    chaos_rng,
    end_on_one_head,
    metrics,
    paced_net,
)
from tests.support.local_net import Net

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

HEARTBEAT_S = 2.0
PAUSES = 2
#: Each pause lasts this many heartbeats, and up to a random quarter more.
PAUSE_HEARTBEATS = 3.0
DEADLINE_S = 2.0
CATCH_UP_S = 10.0


net = paced_net(
    "heartbeat-pauses",
    validators=3,
    deadline_s=DEADLINE_S,
    extra_args=["--heartbeat-s", str(HEARTBEAT_S)],
)


def test_pauses_longer_than_the_heartbeat_are_no_offence(net: Net) -> None:
    rng = chaos_rng(net)
    paused = rng.choice(net.names("validator"))
    others = [n for n in net.names() if n != paused]
    net.wait_height("seed", 1, 60)  # window 1 waits for the slow-starting trainers
    certify(net, net.names(), 1, 30, "everyone in step")
    opened = metrics(net, paused)["connections_opened"]

    for pause in range(1, PAUSES + 1):
        seconds = HEARTBEAT_S * PAUSE_HEARTBEATS * rng.uniform(1.0, 1.25)
        paused_at = net.heights["seed"]
        net.pause(paused)
        net.note(
            f"pause {pause}: {paused} stopped for {seconds:.1f} s at height {net.heights[paused]}"
        )
        net.watch(seconds)
        net.resume(paused)
        height = net.heights["seed"]
        net.note(f"pause {pause}: {paused} continued with the network at height {height}")
        net.check(height > paused_at, f"the network stood still during pause {pause}")
        net.wait_height(paused, height, CATCH_UP_S)
        # the others went on meanwhile, and go on now
        certify(net, others, 1, 4 * DEADLINE_S, f"the network goes on after pause {pause}")

    # the scenario happened: the pauses cost the validator sockets, which it opened again
    reopened = metrics(net, paused)["connections_opened"] - opened
    net.check(reopened > 0, f"{paused} opened no socket after its pauses: none died of them")
    blamed = accusations(net, paused)
    net.check(not blamed, f"{paused} was struck or banned for its pauses:\n" + "\n".join(blamed))
    banning = {n: net.status(n)["banned"] for n in others if net.status(n)["banned"]}
    net.check(not banning, f"nodes hold bans after {paused}'s pauses: {banning}")
    end_on_one_head(net, timeout_s=4 * DEADLINE_S)
