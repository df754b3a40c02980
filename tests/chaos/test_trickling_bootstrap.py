"""A first bootstrap address that answers at 16 bytes per second must not hold a newcomer up.

A real network (a seed, a reducer, two validators with quorum 2, two trainers) certifies a
window every :data:`DEADLINE_S` seconds or so. The test runs a trickling endpoint -- it
accepts any connection and answers any request with a valid-looking HTTP status line and
headers that never end, at 16 bytes per second -- and starts a viewer with ``--bootstrap
<trickling> --bootstrap <seed>``, the trickling one first. Within :data:`JOIN_S` of being
started the viewer must be ready and hold the height the network had when it started. At
the end every node, the viewer included, holds one head with the same weights.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

from tests.support.bad_endpoints import Trickling
from tests.support.liveness import certify, end_on_one_head, paced_net
from tests.support.local_net import Net

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

DEADLINE_S = 2.0
JOIN_S = 10.0
#: The viewer's program: ``p2ptrain`` with the trickling address as its first bootstrap.
BOOTSTRAP_FIRST = [sys.executable, "-m", "tests.support.bootstrap_first"]


net = paced_net("trickling-bootstrap", validators=2, deadline_s=DEADLINE_S)


@pytest.fixture
def trickling() -> Iterator[Trickling]:
    with Trickling() as endpoint:
        yield endpoint


def test_a_trickling_first_bootstrap_does_not_hold_a_viewer_up(
    net: Net, trickling: Trickling
) -> None:
    net.wait_height("seed", 1, 60)  # window 1 waits for the slow-starting trainers
    certify(net, net.names(), 1, 30, "everyone in step")

    height = net.heights["seed"]
    started = time.monotonic()
    net.start("viewer", "viewer", program=[*BOOTSTRAP_FIRST, trickling.address])
    net.note(
        f"viewer started with --bootstrap {trickling.address} first, the network at height {height}"
    )
    net.wait_ready(["viewer"], JOIN_S)
    net.note(
        f"viewer ready after {time.monotonic() - started:.1f} s; the trickling endpoint "
        f"took {trickling.accepted} connections"
    )
    net.wait_height("viewer", height, max(0.0, started + JOIN_S - time.monotonic()))
    print(
        f"viewer at height {height} {time.monotonic() - started:.1f} s after it started; "
        f"the trickling endpoint took {trickling.accepted} connections"
    )
    net.check(trickling.accepted > 0, "the viewer never tried its first bootstrap address")
    end_on_one_head(net, timeout_s=4 * DEADLINE_S)
