"""Prepared shards over a real network: a seed serves a prepared dataset of 64+ MiB; trainers
that hold no data fetch only the shards their leases name (verified by hash) and certify
windows; a mirror that serves corrupted shard bytes is reported, and the trainer that met it
still trains.

One network for the module: a seed (which imports the prepared shards), a validator and two
trainers without data; later a mirror (``--data DIR``, its stored shards then corrupted on
disk: the server sends files without re-hashing them) and a third trainer that asks the
mirror first.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomli_w

from p2ptrain.data.prepare import PreparedDataset, prepare_dataset
from tests.support.local_net import Net, new_net
from tests.support.token_lm import token_rows

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = f"{ROOT / 'tests' / 'support' / 'token_lm.py'}:workload"
LENGTH = 129
#: 540k rows of 129 tokens below 64 (stored as bytes): 70 MB of shards of 1 MiB.
ROWS = 540_000
SAMPLES_PER_SHARD = 8192
WINDOWS = 4
BATCH = 8
INNER_STEPS = 10


def _prepare(workdir: Path) -> PreparedDataset:
    source = workdir / "tokens"
    source.mkdir()
    np.save(source / "input_ids.npy", token_rows(ROWS, LENGTH, seed=1))
    prepared = prepare_dataset(
        source, workdir / "prepared", name="tokens", samples_per_shard=SAMPLES_PER_SHARD
    )
    (source / "input_ids.npy").unlink()  # nobody but the seed holds the data now
    return prepared


def _experiment(net: Net, prepared: PreparedDataset) -> Path:
    tables: dict[str, Any] = {
        "study": "sharded-test",
        "name": "tokens",
        "inner_steps": INNER_STEPS,
        "validators": [net.network.identity("validator-0")],
        "reducers": [],
        "quorum": 1,
        "workload": {
            "reference": REFERENCE,
            "config": {"length": LENGTH, "batch_size": BATCH},
        },
        "inner_optimizer": {"name": "adamw", "lr": 3e-3},
        "window": {"deadline_s": 30.0, "proposal_s": 3.0, "min_updates": 2, "max_updates": 2},
        "data": {"prepared": str(prepared.path)},
    }
    path = net.workdir / "experiment.toml"
    path.write_text(tomli_w.dumps(tables))
    return path


@pytest.fixture(scope="module")
def sharded_net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Net, PreparedDataset]]:
    workdir = tmp_path_factory.mktemp("sharded")
    prepared = _prepare(workdir)
    net = new_net(workdir)
    try:
        path = _experiment(net, prepared)
        net.start("seed", "seed", args=["--experiment-toml", str(path)])
        net.wait_ready(["seed"])
        net.start("validator-0", "validator")
        for name in ("trainer-0", "trainer-1"):
            net.start(name, "trainer", args=["--workload", REFERENCE])
        net.wait_ready(["validator-0", "trainer-0", "trainer-1"])
        yield net, prepared
    finally:
        net.close()


def test_the_prepared_dataset_is_big_and_sharded(
    sharded_net: tuple[Net, PreparedDataset],
) -> None:
    _, prepared = sharded_net
    manifest = prepared.manifest
    assert manifest.kind == "sharded"
    assert manifest.total_bytes >= 64 << 20
    assert manifest.total_samples == ROWS
    assert len(manifest.shards) == -(-ROWS // SAMPLES_PER_SHARD)


def test_trainers_without_data_fetch_only_their_leases_shards_and_certify(
    sharded_net: tuple[Net, PreparedDataset],
) -> None:
    net, prepared = sharded_net
    net.wait_height("seed", WINDOWS, 180)
    sizes = {s.name: s.bytes for s in prepared.manifest.shards}
    for name in ("trainer-0", "trainer-1"):
        seen: dict[str, Any] = {}

        def consistent(name: str = name, seen: dict[str, Any] = seen) -> bool:
            # the status file is written now and then: wait for one that has every fetch
            # the events told of so far
            data = net.status(name).get("data") or {}
            fetched = {s for e in net.events("shards_fetched", name) for s in e["shards"]}
            seen.update(data=data, names=fetched)
            return bool(fetched) and data.get("fetched_shards") == len(fetched)

        net.wait_until(f"{name} reports the shards it fetched", 30, consistent)
        data, names = seen["data"], seen["names"]
        net.check(data["kind"] == "sharded", f"{name} data: {data}")
        net.check(
            data["downloaded_bytes"] <= 1.2 * data["leased_bytes"],
            f"{name} downloaded {data['downloaded_bytes']} bytes for leases naming "
            f"{data['leased_bytes']} bytes of shards: {json.dumps(data)}",
        )
        net.check(
            sum(sizes[n] for n in names) <= data["leased_bytes"],
            f"{name} fetched shards its leases did not name: {sorted(names)} / {data}",
        )
        net.check(
            data["shards_held"] < len(prepared.manifest.shards) // 4,
            f"{name} holds {data['shards_held']} shards: more than its leases need",
        )
    accepted = [e for e in net.events("adopted", "seed") if e["accepted"] >= 1]
    net.check(len(accepted) >= WINDOWS, "the certified windows took no updates")


def test_a_mirror_serving_corrupted_shards_is_reported_and_the_trainer_still_trains(
    sharded_net: tuple[Net, PreparedDataset],
) -> None:
    net, prepared = sharded_net
    mirror = net.start(
        "mirror", "viewer", args=["--data", str(prepared.path), "--listen", "127.0.0.1:0"]
    )
    net.wait_ready(["mirror"])
    blob_ids = {s.blob_id for s in prepared.manifest.shards}
    corrupted = 0
    for path in (net.data_dir("mirror")).rglob("*"):
        if path.is_file() and path.name in blob_ids:
            with path.open("r+b") as file:  # one flipped byte in every 64 KiB
                size = path.stat().st_size
                for offset in range(0, size, 1 << 16):
                    file.seek(offset)
                    byte = file.read(1)
                    file.seek(offset)
                    file.write(bytes([byte[0] ^ 0xFF]))
            corrupted += 1
    assert corrupted == len(blob_ids), f"the mirror holds {corrupted} of {len(blob_ids)} shards"
    seed = net.network.seed
    assert seed is not None and seed.address is not None and mirror.address is not None
    height = net.heights["seed"]
    net.start(
        "trainer-2",
        "trainer",
        args=["--workload", REFERENCE],
        bootstrap=[mirror.address, seed.address],  # the mirror is asked first
    )
    net.wait_ready(["trainer-2"])
    mirror_id = net.peer_ids["mirror"]
    net.wait_until(
        "trainer-2 reports the mirror",
        60,
        lambda: any(e["peer"] == mirror_id for e in net.events("reported", "trainer-2")),
    )
    reasons = [e["reason"] for e in net.events("reported", "trainer-2")]
    net.check(any("bad blob" in r for r in reasons), f"reported for {reasons}")
    net.wait_until(
        "trainer-2 trains a window after meeting the mirror",
        90,
        lambda: bool(net.events("published", "trainer-2")),
    )
    net.wait_height("seed", height + 2, 120)
