"""A window that waits says for what, and closes early once the trainers that are alive
have reported: three trainers, ``min_updates`` 2, one of them stopped.

The validator (q = 1, it also proposes) hears from each trainer every heartbeat (5 s here),
so a stopped trainer is no longer expected after :data:`PRESENCE_HEARTBEATS` heartbeats.
While the stopped trainer is still expected, the validator's status and dashboard say
"2 of 3 expected updates (min 2) ...; waiting for trainers <its id>"; then the window closes,
long before its 60 s deadline.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from p2ptrain.observe.status import STATUS_FILE
from tests.support.local_net import Net, new_net, reaped

pytestmark = pytest.mark.integration

HEARTBEAT_S = 5.0
DEADLINE_S = 60.0
#: The window after the stop takes training, the presence timeout and certifying: far
#: less than the deadline on a busy 2-core machine.
EARLY_S = 30.0


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Net]:
    yield from reaped(lambda: new_net(tmp_path_factory.mktemp("stalled-window")), request)


def _roles(status: dict[str, Any]) -> dict[str, str]:
    return {r["role"]: r["last_reason"] for r in status.get("role_states", [])}


def test_a_window_waits_for_the_live_trainers_only_and_says_so(net: Net) -> None:
    net.launch(
        validators=1,
        reducers=0,
        trainers=3,
        quorum=1,
        min_updates=2,
        max_updates=3,
        deadline_s=DEADLINE_S,
        extra_args=["--heartbeat-s", str(HEARTBEAT_S)],
    )
    for name in net.network.nodes:  # a node that said it is ready has written its status
        assert (net.data_dir(name) / STATUS_FILE).is_file(), f"{name} has no status yet"
    net.wait_height("validator-0", 1, 120)
    stopped = net.network.nodes["trainer-2"].peer_id
    net.kill("trainer-2")
    waiting = "2 of 3 expected updates (min 2), deadline in"
    named = f"waiting for trainers {stopped[:12]}"
    address = net.network.nodes["validator-0"].address
    seen: dict[str, str] = {}

    def says_it_waits() -> bool:
        reason = _roles(net.status("validator-0")).get("validator", "")
        if waiting in reason and named in reason:
            seen["status"] = reason
            seen["height"] = str(net.heights["validator-0"])
        with urllib.request.urlopen(f"{address}/api/snapshot", timeout=10) as answer:
            page = answer.read().decode()
        if waiting in page and named in page:
            seen["dashboard"] = page
        return "status" in seen and "dashboard" in seen

    net.wait_until(
        "the validator's status and dashboard to name the stopped trainer", 60, says_it_waits
    )
    # the window it waited in certifies once the stopped trainer is no longer expected,
    # and the next at once: both long before the deadline, each with the two live updates
    height = int(seen["height"])
    net.wait_height("validator-0", height + 2, 2 * EARLY_S)
    adopted = {e["height"]: e for e in net.events("adopted", "validator-0")}
    for window in (height + 1, height + 2):
        event = adopted[window]
        assert event["seconds"] < EARLY_S, event
        assert event["accepted"] == 2, event
    assert adopted[height + 1]["seconds"] < DEADLINE_S / 2
