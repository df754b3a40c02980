"""A join keeps every bootstrap that answers: one that trickles the genesis weights costs
seconds, never the join; a join fails only when every bootstrap failed, naming what each did.

A running seed of the tiny experiment serves the module. Each join calls
:func:`p2ptrain.node.setup.prepare` in this process (the join path of a node, without the
node), through :class:`~tests.support.bad_endpoints.Relay` endpoints in front of the seed:
one that answers the manifests and trickles whatever it is asked for a blob at 16 bytes per
second, given first, and a healthy one whose answers come a random while later (before or
after the join's grace for late answers). Every join must succeed within :data:`JOIN_S`.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from p2ptrain.errors import LocalError
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.setup import NodeSettings, Prepared, prepare
from p2ptrain.store.datadir import DataDir
from tests.support.bad_endpoints import Relay, Unanswering
from tests.support.liveness import SEED_ENV
from tests.support.local_net import Net, lone_seed

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

RUNS = 10
#: One join through a trickling first bootstrap: the fetcher drops it within about 3 s
#: (its rate is measured over 2 s) and takes the genesis from the healthy one.
JOIN_S = 10.0
#: The longest the healthy bootstrap's answers are held back.
MAX_DELAY_S = 1.0


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    """A running seed of a tiny experiment (nobody else: a join needs only the seed)."""
    yield from lone_seed(tmp_path_factory.mktemp("join-bootstraps"))


def _where(seed: Net) -> tuple[str, str]:
    """The seed's address and the experiment it serves."""
    address, experiment_id = seed.network.nodes["seed"].address, seed.network.experiment_id
    assert address is not None and experiment_id is not None
    return address, experiment_id


def _join(
    data_dir: Path,
    experiment_id: str,
    bootstrap: Sequence[str],
    *,
    timeout_s: float,
    join_timeout_s: float = 60.0,
) -> Prepared:
    """What a viewer started with ``--bootstrap`` for each of ``bootstrap`` prepares."""
    settings = NodeSettings(
        data_dir=data_dir,
        roles=("viewer",),
        experiment_id=experiment_id,
        bootstrap=tuple(bootstrap),
        join_timeout_s=join_timeout_s,
    )

    async def bounded() -> Prepared:
        async with asyncio.timeout(timeout_s):
            with DataDir(data_dir, exclusive=True) as datadir:
                return await prepare(settings, NodeStore(datadir))

    return asyncio.run(bounded())


def test_a_first_bootstrap_that_trickles_the_genesis_costs_seconds_not_the_join(
    seed: Net, tmp_path: Path
) -> None:
    address, experiment_id = _where(seed)
    number = int(os.environ.get(SEED_ENV) or secrets.randbits(32))
    replay = f"random seed {number} (replay with {SEED_ENV}={number})"
    print(replay)
    rng = random.Random(number)
    asked_for_blobs = 0
    for run in range(RUNS):
        delay_s = rng.uniform(0.0, MAX_DELAY_S)
        what = f"run {run + 1} of {RUNS}, the healthy bootstrap's answers {delay_s:.2f} s late"
        with (
            Relay(address, trickle_blobs=True) as trickling,
            Relay(address, delay_s=delay_s) as healthy,
        ):
            started = time.monotonic()
            try:
                prepared = _join(
                    tmp_path / f"run-{run}",
                    experiment_id,
                    [trickling.address, healthy.address],
                    timeout_s=JOIN_S,
                )
            except (LocalError, TimeoutError) as exc:
                pytest.fail(f"{what}: the join failed ({exc!r}); {replay}")
            took = time.monotonic() - started
            print(f"{what}: joined in {took:.1f} s; {trickling.blob_requests} blob asks trickled")
            assert prepared.experiment.record_id == experiment_id, replay
            assert trickling.accepted > 0, f"{what}: the trickling bootstrap was never asked"
            asked_for_blobs += trickling.blob_requests
    # otherwise the genesis always came from the healthy one, and nothing was tested
    assert asked_for_blobs > 0, f"no join asked the trickling bootstrap for the genesis; {replay}"


def test_a_lone_bootstrap_whose_genesis_download_stalls_once_is_asked_again(
    seed: Net, tmp_path: Path
) -> None:
    """Several nodes joining at once through one slow link: one download stalls, is dropped
    as too slow, and the join tries that bootstrap again (resuming) instead of giving up."""
    address, experiment_id = _where(seed)
    with Relay(address, trickle_blobs=True, trickled=1) as stalling:
        prepared = _join(tmp_path, experiment_id, [stalling.address], timeout_s=2 * JOIN_S)
    assert prepared.experiment.record_id == experiment_id
    assert stalling.blob_requests == 1, "the one bootstrap's genesis download never stalled"


@pytest.fixture
def refusing() -> Iterator[str]:
    """The address of a loopback port nobody listens on (connections are refused)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = int(listener.getsockname()[1])
    yield f"http://127.0.0.1:{port}"


def test_a_join_that_every_bootstrap_fails_names_what_each_did(
    seed: Net, tmp_path: Path, refusing: str
) -> None:
    address, experiment_id = _where(seed)
    with Relay(address, trickle_blobs=True) as trickling, Unanswering() as silent:
        bootstrap = [trickling.address, silent.address, refusing]
        with pytest.raises(LocalError) as raised:
            _join(tmp_path, experiment_id, bootstrap, timeout_s=2 * JOIN_S, join_timeout_s=3.0)
    message = str(raised.value)
    print(message)
    assert message.startswith(f"cannot join experiment {experiment_id[:16]}: "), message
    said = _what_each_did(message, bootstrap)
    assert said[trickling.address].startswith("the genesis weights: "), message
    assert "too slow" in said[trickling.address], message
    assert said[silent.address] == "no answer within 3s", message
    assert said[refusing].startswith(f"cannot reach {refusing}"), message
    assert trickling.blob_requests > 0, "the trickling bootstrap was never asked for the genesis"


def _what_each_did(message: str, addresses: Sequence[str]) -> dict[str, str]:
    """The reason a join's error gives for each bootstrap, which it names in order:
    ``cannot join experiment X: A: why; B: why. What to do``."""
    rest = message.split(": ", 1)[1]
    said = {}
    for index, address in enumerate(addresses):
        assert rest.startswith(f"{address}: "), message
        after = addresses[index + 1] if index + 1 < len(addresses) else None
        end = rest.index(f"; {after}: ") if after else rest.rindex(". ")
        said[address] = rest[len(address) + 2 : end]
        rest = rest[end + 2 :]
    return said
