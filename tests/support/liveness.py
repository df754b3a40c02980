"""What the liveness tests (``tests/chaos``) measure and check on a :class:`Net`.

* :func:`paced_net` -- a module's network fixture: :func:`launch_paced` in a fresh work dir;
* :func:`chaos_rng` -- the test's random choices, seeded and the seed in every failure;
* :func:`certify` -- wait until nodes advance a number of windows, within a time that says
  what rate is required, and return how long each took;
* :func:`accusations` -- the log lines in which other nodes strike or ban a peer;
* :func:`metrics` -- a serving node's counters (``GET /metrics``, loopback only);
* :func:`end_on_one_head` -- stop the training and check that every node ends on one head
  with the same weights (:func:`~tests.support.local_net.check_one_tip`).
"""

from __future__ import annotations

import os
import random
import secrets
import urllib.request
from collections.abc import Callable, Iterator, Sequence

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.local_net import Net, check_one_tip, new_net

__all__ = [
    "SEED_ENV",
    "accusations",
    "certify",
    "chaos_rng",
    "end_on_one_head",
    "launch_paced",
    "metrics",
    "paced_net",
]

#: Set to an integer to replay a chaos test's random choices.
SEED_ENV = "P2PTRAIN_CHAOS_SEED"
#: What starting a node again may take on a busy 2-core machine, before it catches up.
RESTART_S = 30.0


def launch_paced(
    net: Net,
    *,
    validators: int,
    deadline_s: float,
    max_updates: int | None = 3,
    extra_args: Sequence[str] = (),
) -> None:
    """Launch a seed, a reducer, ``validators`` validators (quorum 2) and two trainers
    whose windows need both updates (``min_updates=2``) and, with ``max_updates=3``, never
    fill; the nodes do not close a window once both trainers reported (``--no-early-close``):
    every window runs to its deadline, so the certification rate is steady under load and a
    fault shows as windows that take longer."""
    net.launch(
        validators=validators,
        reducers=1,
        trainers=2,
        min_updates=2,
        max_updates=max_updates,
        quorum=2,
        deadline_s=deadline_s,
        proposal_s=1.0,
        extra_args=["--no-early-close", *extra_args],
    )


def paced_net(
    name: str,
    *,
    validators: int,
    deadline_s: float,
    max_updates: int | None = 3,
    extra_args: Sequence[str] = (),
) -> Callable[[pytest.TempPathFactory], Iterator[Net]]:
    """A module-scoped fixture named ``net`` (assign it to ``net`` in the test module): a
    network of :func:`launch_paced` in a fresh work dir named ``name``, closed (every
    process reaped) after the module."""

    @pytest.fixture(scope="module")
    def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
        network = new_net(tmp_path_factory.mktemp(name))
        try:
            launch_paced(
                network,
                validators=validators,
                deadline_s=deadline_s,
                max_updates=max_updates,
                extra_args=extra_args,
            )
            yield network
        finally:
            network.close()

    return net


def chaos_rng(net: Net) -> random.Random:
    """The test's random choices; their seed (``$P2PTRAIN_CHAOS_SEED`` or a fresh one) is
    printed and named in every failure message of ``net``."""
    seed = int(os.environ.get(SEED_ENV) or secrets.randbits(32))
    line = f"random seed {seed} (replay with {SEED_ENV}={seed})"
    print(line)
    net.note(line)
    return random.Random(seed)


def certify(net: Net, names: Sequence[str], windows: int, allowed_s: float, why: str) -> float:
    """Time ``windows`` whole windows: from the moment every node of ``names`` adopted the
    next height above the highest any of them holds now, to the moment every one adopted
    ``windows`` more. Fail unless they took at most ``allowed_s`` seconds (``why``: the rate
    that limit stands for, named in the failure); return the seconds they took."""
    took, what = timed_windows(net, names, windows, allowed_s * (windows + 1) / windows, why)
    net.check(took <= allowed_s, f"{what} within {allowed_s:.1f} s: {why}; they took {took:.1f} s")
    return took


def timed_windows(
    net: Net, names: Sequence[str], windows: int, wait_s: float, why: str
) -> tuple[float, str]:
    """The seconds ``windows`` whole windows took (as :func:`certify` times them), waiting
    at most ``wait_s`` for them (failing after that), and what was timed, in words."""
    first = max(net.heights.get(n, 0) for n in names) + 1
    target = first + windows

    def adopted_at(height: int) -> float:
        """When the last of ``names`` adopted ``height`` (or a later one)."""
        return max(
            min(
                s
                for s, n, e in net.history
                if n == name and e["event"] == "adopted" and e["height"] >= height
            )
            for name in names
        )

    what = (
        f"{', '.join(names)} to adopt heights {first} to {target} ({windows} windows after "
        "the first)"
    )
    # the wait for height ``first`` is not timed, but it counts against the limit
    net.wait(
        f"{what} within {wait_s:.1f} s: {why}",
        wait_s,
        lambda: all(net.heights.get(n, 0) >= target for n in names),
    )
    return adopted_at(target) - adopted_at(first), what


def accusations(net: Net, accused: str) -> list[str]:
    """The lines of the other nodes' logs that strike or ban the node ``accused``."""
    prefix = net.peer_ids[accused][:16]
    return [
        f"{name}: {line.strip()}"
        for name in net.names()
        if name != accused
        for line in net.log(name)
        if prefix in line and ("strike" in line or "banned" in line)
    ]


def metrics(net: Net, name: str) -> dict[str, float]:
    """The unlabelled figures the serving node ``name`` answers at ``GET /metrics``, without
    their ``p2ptrain_`` prefix and counters' ``_total`` (``connections_opened``,
    ``gossip_delivered``, ...)."""
    address = net.network.nodes[name].address
    net.check(address is not None, f"{name} serves nothing: it has no metrics")
    with urllib.request.urlopen(f"{address}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    counters = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("p2ptrain_") and not sample.labels:
                name = sample.name.removeprefix("p2ptrain_").removesuffix("_total")
                counters[name] = float(sample.value)
    return counters


def end_on_one_head(net: Net, timeout_s: float) -> int:
    """Stop the trainers; wait until every other running node adopted the last window the
    trainers published enough updates for (no window after it can fill); start the trainers that
    had not adopted it again, to catch up and stop there by themselves; stop the others and
    check that every node's stored tip is one head, with the same weights. Return its
    height."""
    trainers = [n for n in net.names("trainer") if n not in net.exited]
    net.stop(trainers)
    others = [n for n in net.roles if n not in net.exited]
    # a trainer stopped while training leaves its window one update short of the quorum
    filled = [w for w, names in net.publishers().items() if len(names) >= net.min_updates]
    height = max(max(filled, default=0), *(net.heights.get(n, 0) for n in others))
    net.wait(
        f"{', '.join(others)} to adopt height {height}, the last window the stopped "
        f"trainers published the {net.min_updates} update(s) it needs for",
        timeout_s,
        lambda: all(net.heights.get(n, 0) >= height for n in others),
    )
    # a trainer may stop holding a certified head whose weights it had not fetched yet
    behind = [n for n in trainers if net.heights.get(n, 0) < height]
    for name in behind:
        net.start(name, "trainer", windows=height)
    net.wait_exits(behind, timeout_s + RESTART_S)
    net.check(
        all(net.stopped.get(n) == height for n in behind),
        f"the restarted trainers should stop at height {height}: {net.stopped}",
    )
    net.stop(others)
    check_one_tip(net, height)
    return height
