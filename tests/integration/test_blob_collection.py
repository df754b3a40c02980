"""A node's disk stays bounded (DESIGN §6): a seed, a reducer, 2 validators (q = 2) and 2
trainers certify 80 sub-second windows of the tiny char-GPT (some 15 times the heads and
windows any node keeps), and at every window the seed certifies, each node's blob store --
partial downloads, temporaries and everything else under ``<dir>/blobs`` included -- holds
no more than its last K heads' weights and optimizer state (one more head while a new one
arrives), a few windows' updates and the genesis weights. Each node keeps its own K
(``--keep-heads``, 1 to 3). A partial download abandoned long ago and a blob nobody names,
planted before the nodes start, are gone; the nodes' ``status.json`` counts the store's
bytes and what was collected."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.net.partial_file import PARTIAL_DIR
from p2ptrain.node.local_network import experiment_toml
from p2ptrain.protocol.retention import DEFAULT_KEEP_HEADS, UPDATE_WINDOWS_KEPT
from p2ptrain.store.blobs import BlobStore
from p2ptrain.store.datadir import BLOBS_DIR, DataDir
from tests.support.builders import h
from tests.support.local_net import TINY_CONFIG, Net, check_one_tip, local_net, stored_chain

__all__ = ["local_net"]  # the fixture

pytestmark = pytest.mark.integration

WINDOWS = 80
TRAINERS = 2
#: Few inner steps: a window is mostly the protocol's round trips (a fraction of a second).
INNER_STEPS = 2
DEADLINE_S = 20.0
PROPOSAL_S = 3.0
#: Each node's --keep-heads (None: the default).
KEEP_HEADS: dict[str, int | None] = {
    "seed": 2,
    "reducer-0": 2,
    "validator-0": None,
    "validator-1": 1,
    "trainer-0": 2,
    "trainer-1": 1,
}
#: Planted in these data directories before their nodes start, written two hours ago.
PLANTED = ("validator-0", "trainer-0")
TWO_HOURS_S = 7200.0


def store_bytes(data_dir: Path) -> int:
    """Every byte under ``<dir>/blobs``: blobs, partial downloads, temporaries."""
    total = 0
    for directory, _subdirectories, files in os.walk(data_dir / BLOBS_DIR):
        for name in files:
            try:
                total += os.stat(os.path.join(directory, name)).st_size
            except FileNotFoundError:  # collected while we walked
                continue
    return total


def plant(data_dir: Path) -> tuple[str, str]:
    """An abandoned partial download and a blob nobody names; returns their ids."""
    then = time.time() - TWO_HOURS_S
    with BlobStore(data_dir / BLOBS_DIR) as blobs:
        stray = blobs.put(b"a blob left from an earlier life" * 1000)
        os.utime(blobs.path(stray), (then, then))
        partial = blobs.root / PARTIAL_DIR
    abandoned = h(f"abandoned in {data_dir.name}")
    partial.mkdir(exist_ok=True)
    for name in (abandoned, f"{abandoned}.json"):
        (partial / name).write_bytes(b"\0" * 50_000)
        os.utime(partial / name, (then, then))
    return stray, abandoned


def test_every_node_keeps_its_store_bounded_for_80_windows(local_net: Net) -> None:
    net = local_net
    started = time.monotonic()
    validators = ["validator-0", "validator-1"]
    trainers = [f"trainer-{i}" for i in range(TRAINERS)]
    toml = experiment_toml(
        validators=[net.network.identity(n) for n in validators],
        reducers=[net.network.identity("reducer-0")],
        quorum=2,
        workload={"name": "char-gpt", "config": TINY_CONFIG},
        inner_steps=INNER_STEPS,
        deadline_s=DEADLINE_S,
        proposal_s=PROPOSAL_S,
        min_updates=TRAINERS,
        max_updates=TRAINERS,
        inner_lr=float(TINY_CONFIG["lr"]),
    )
    path = net.network.write_experiment(toml)

    def keep(name: str) -> list[str]:
        k = KEEP_HEADS[name]
        return [] if k is None else ["--keep-heads", str(k)]

    planted = {name: plant(net.data_dir(name)) for name in PLANTED}
    net.start("seed", "seed", args=["--experiment-toml", str(path), *keep("seed")])
    net.wait_ready(["seed"])
    net.windows = WINDOWS
    net.start("reducer-0", "reducer", args=keep("reducer-0"))
    for name in validators:
        net.start(name, "validator", args=keep(name))
    for name in trainers:
        net.start(name, "trainer", windows=WINDOWS, args=keep(name))
    net.wait_ready(["reducer-0", *validators, *trainers])

    # every node's store, at each window the seed certifies
    largest = dict.fromkeys(KEEP_HEADS, 0)
    while net.heights.get("seed", 0) < WINDOWS:
        net.wait_event(
            "the seed to adopt the next window",
            60,
            lambda name, event: name == "seed" and event["event"] == "adopted",
        )
        for name in largest:
            largest[name] = max(largest[name], store_bytes(net.data_dir(name)))
    net.finish(timeout_s=60.0)
    elapsed = time.monotonic() - started
    check_one_tip(net, WINDOWS)

    # what genesis, one head and one window's updates weigh
    tip, _certificate = stored_chain(net.data_dir("seed"))[-1]
    with DataDir(net.data_dir("seed")) as seed:
        experiment = seed.state.get_record(tip.experiment_id)
        assert experiment is not None and tip.optimizer_blob is not None
        genesis = open_envelope(experiment, ExperimentManifest).record.genesis_weights
        genesis_bytes = seed.blobs.size(genesis)
        assert tip.aggregate_blob is not None
        # a kept head keeps its weights, its outer momentum and the aggregate that made it
        head_bytes = sum(
            seed.blobs.size(blob)
            for blob in (tip.weights_blob, tip.optimizer_blob, tip.aggregate_blob)
        )
    update_bytes = max(e["blob_bytes"] for e in net.events("trained"))
    window_bytes = TRAINERS * update_bytes

    def bound(name: str) -> int:
        """K heads and one arriving, the windows kept, the open one and the next (trained
        on the new head before our pass ran), and one more head and window for a pass
        that runs late on two busy cores."""
        k = KEEP_HEADS[name] or DEFAULT_KEEP_HEADS
        heads, windows = k + 1 + 1, UPDATE_WINDOWS_KEPT + 2 + 1
        return genesis_bytes + heads * head_bytes + windows * window_bytes

    report = [
        f"{name}: at most {most} bytes, bound {bound(name)}" for name, most in largest.items()
    ]
    print(
        f"\n{WINDOWS} windows in {elapsed:.0f} s; a head {head_bytes} bytes, a window's "
        f"updates {window_bytes}, genesis {genesis_bytes}; " + "; ".join(report)
    )
    for name, most in largest.items():
        net.check(most <= bound(name), f"{name}'s store grew past its bound: {report}")
        status = net.status(name)
        kept = (status["keep_heads"], status["collect_failures"])
        net.check(kept == (KEEP_HEADS[name] or DEFAULT_KEEP_HEADS, 0), f"{name}: {status}")
        net.check(status["blobs_collected"] > WINDOWS, f"{name} collected too little: {status}")
        blobs = list((net.data_dir(name) / BLOBS_DIR).glob("[0-9a-f][0-9a-f]/*"))
        counted = (status["store_blobs"], status["store_bytes"])
        net.check(
            counted == (len(blobs), sum(b.stat().st_size for b in blobs)),
            f"{name}'s status.json counts its store otherwise: {counted}",
        )
    for name, (stray, abandoned) in planted.items():
        partial = net.data_dir(name) / BLOBS_DIR / PARTIAL_DIR
        net.check(not (partial / abandoned).exists(), f"{name} kept an abandoned download")
        net.check(not (partial / f"{abandoned}.json").exists(), f"{name} kept its record")
        with BlobStore(net.data_dir(name) / BLOBS_DIR) as store:
            net.check(not store.has(stray), f"{name} kept a blob nobody names")
