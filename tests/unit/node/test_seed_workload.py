"""A seed given the user's own workload records in the manifest what a trainer needs to
build and check the same one: the reference, the config hash, the batch size and the
schema hash of the genesis weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from p2ptrain.core.identity import Identity
from p2ptrain.core.tensors import schema_hash
from p2ptrain.node.local_network import experiment_toml
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.setup import NodeSettings, Prepared, prepare
from p2ptrain.store.datadir import DataDir
from p2ptrain.torch.registry import config_hash

MODEL_FILE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


def workload(config):
    torch.manual_seed(0)
    model = nn.Linear(4, int(config["width"]))
    data = TensorDataset(torch.zeros(24, 4), torch.zeros(24, dtype=torch.long))
    return {"model": model, "train": data, "val": data, "batch_size": 3,
            "samples_per_shard": 8}
"""


def _seed(tmp_path: Path, name: str, given: str | None) -> Prepared:
    definition = tmp_path / "experiment.toml"
    definition.write_text(
        experiment_toml(
            validators=[Identity.generate().public_key.hex()],
            reducers=[],
            quorum=1,
            workload={"name": name, "config": {"width": 2}},
            inner_steps=5,
            deadline_s=10.0,
            proposal_s=2.0,
            min_updates=1,
            max_updates=2,
        )
    )
    data_dir = tmp_path / "seed"
    settings = NodeSettings(
        data_dir=data_dir, roles=("seed",), experiment_toml=definition, workload=given
    )
    with DataDir(data_dir, exclusive=True) as datadir:
        return asyncio.run(prepare(settings, NodeStore(datadir)))


@pytest.mark.parametrize("by", ["toml", "flag"])
def test_the_seed_records_the_reference_hashes_and_batch_size(tmp_path: Path, by: str) -> None:
    code = tmp_path / "nets" / "tiny.py"
    code.parent.mkdir()
    code.write_text(MODEL_FILE)
    reference = f"{code}:workload"
    if by == "toml":
        prepared = _seed(tmp_path, reference, None)
    else:
        prepared = _seed(tmp_path, "placeholder", reference)
    manifest = prepared.experiment.record
    spec = manifest.workload
    assert spec.reference == reference
    assert spec.name == "nets.tiny.workload"
    assert spec.config == {"width": 2}
    assert spec.config_hash == config_hash({"width": 2}, None)
    assert spec.batch_size == 3
    assert spec.schema_hash == schema_hash(prepared.genesis)
    assert prepared.genesis["weight"].shape == (2, 4)
    assert manifest.lease_size == 5 * 3  # inner steps x batch size
    assert [s.samples for s in manifest.dataset.shards] == [8, 8, 8]
