"""One of three validators paused (SIGSTOP) must not slow the others down.

A real network (a seed, a reducer, three validators with quorum 2, two trainers) certifies
a window every :data:`DEADLINE_S` seconds or so (no window fills, so that the rate stands
still when the machine is busy; each needs both trainers' updates). A validator chosen at
random is paused: it keeps its sockets open and answers nothing, neither gossip nor HTTP.
Every other node must go on adopting heads -- the trainers included, which fetch each new
head's weights -- at :data:`RATE_KEPT` of the rate measured before at least, and once the
validator is continued it must be back at the network's height within
:data:`CATCH_UP_S`. Nobody strikes or bans it for having been silent. At the end every node
holds one head with the same weights.
"""

from __future__ import annotations

import pytest

from tests.support.liveness import accusations, certify, chaos_rng, end_on_one_head, paced_net
from tests.support.local_net import Net

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

DEADLINE_S = 2.0
#: Windows certified in each measured stretch.
STRETCH = 6
#: The rate while the validator is paused, as a share of the rate before, at least.
RATE_KEPT = 0.8
HEALTHY_STRETCH_S = 60.0
CATCH_UP_S = 10.0


net = paced_net("paused-validator", validators=3, deadline_s=DEADLINE_S)


def test_a_paused_validator_does_not_stop_the_others(net: Net) -> None:
    rng = chaos_rng(net)
    paused = rng.choice(net.names("validator"))
    others = [n for n in net.names() if n != paused]
    net.wait_height("seed", 1, 60)  # window 1 waits for the slow-starting trainers
    certify(net, net.names(), 1, 30, "everyone in step")
    before_s = certify(net, others, STRETCH, HEALTHY_STRETCH_S, "a healthy network")
    net.note(f"{STRETCH} windows took {before_s:.1f} s before {paused} was paused")

    net.pause(paused)
    net.note(f"{paused} paused at height {net.heights[paused]}")
    during_s = certify(
        net,
        others,
        STRETCH,
        before_s / RATE_KEPT,
        f"at least {RATE_KEPT:.0%} of the {60 * STRETCH / before_s:.0f} windows/min before "
        f"{paused} was paused",
    )
    net.resume(paused)
    height = net.heights["seed"]
    net.note(f"{paused} continued with the network at height {height}")
    net.wait_height(paused, height, CATCH_UP_S)
    print(
        f"{STRETCH} windows: {before_s:.1f} s before {paused} was paused, "
        f"{during_s:.1f} s while it was"
    )

    blamed = accusations(net, paused)
    net.check(not blamed, f"{paused} was struck or banned for a pause:\n" + "\n".join(blamed))
    end_on_one_head(net, timeout_s=4 * DEADLINE_S)
