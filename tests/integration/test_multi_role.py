"""A node of several roles: three friends who each train and validate (one process each,
``p2ptrain node --role trainer --role validator``, quorum 2) certify windows together, each
node following the chain once for both its roles."""

from __future__ import annotations

import pytest

from p2ptrain.observe.status import read_status
from tests.support.local_net import Net, check_one_tip, local_net  # noqa: F401

pytestmark = pytest.mark.integration

WINDOWS = 5
FRIENDS = [f"friend-{i}" for i in range(3)]


def test_three_nodes_that_each_train_and_validate_certify_windows(local_net: Net) -> None:  # noqa: F811
    net = local_net
    path = net.write_experiment(validators=FRIENDS, quorum=2, max_updates=len(FRIENDS))
    net.start("seed", "seed", args=["--experiment-toml", str(path)])
    net.wait_ready(["seed"])
    for name in FRIENDS:
        net.start(name, ("trainer", "validator"), windows=WINDOWS)
    net.wait_ready(FRIENDS)
    # each friend stops by itself once it holds height 5 (serving its last head a while)
    net.wait_exits(FRIENDS, 180)
    net.wait_height("seed", WINDOWS, 60)
    net.stop(["seed"])
    assert all(net.stopped[name] == WINDOWS for name in FRIENDS), net.stopped
    check_one_tip(net, WINDOWS)  # everyone ends on one head and the same weights

    for name in FRIENDS:
        ready = next(e for e in net.events("ready", name))
        assert list(ready["roles"]) == ["trainer", "validator"]
        published = {e["window"] for e in net.events("published", name)}
        attested = {e["height"] for e in net.events("attested", name)}
        net.check(bool(published), f"{name} published no update")
        net.check(bool(attested), f"{name} attested no head")
        status = read_status(net.data_dir(name))
        assert {s.role for s in status.role_states} == {"trainer", "validator"}
        assert status.trainer is not None and not status.errors
        # one adopted event per height, whichever of its roles adopted first
        heights = [e["height"] for e in net.events("adopted", name)]
        assert heights == sorted(set(heights)) and heights[-1] == WINDOWS
        # what following the chain cost it: one chain for both roles, one outer step and
        # one certificate verification per head
        print(
            f"{name}: {status.chains} chains, {status.heads_adopted} heads adopted, "
            f"{status.outer_steps} outer steps, {status.certificate_checks} certificate checks"
        )
        assert status.heads_adopted == len(heights) == WINDOWS
        assert status.chains == 1
        assert status.outer_steps == status.heads_adopted
        assert status.certificate_checks == status.heads_adopted
        assert status.peak_rss_mib > 0
    # every certified window took updates from more than one friend at least once: the
    # trainers' updates reach the validator in their own process and the others
    accepted = [e["accepted"] for e in net.events("adopted", "seed")]
    assert max(accepted) >= 2, accepted
