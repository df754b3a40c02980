"""A seed restarted on its data directory with ``--experiment-toml`` serves its experiment only
if the file still defines that very experiment; another one is refused, naming both ids."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from p2ptrain.core.identity import Identity
from p2ptrain.errors import LocalError
from p2ptrain.node.local_network import experiment_toml
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.setup import NodeSettings, Prepared, prepare
from p2ptrain.store.datadir import DataDir
from p2ptrain.torch.registry import register
from p2ptrain.torch.workload import TorchWorkload

WORKLOAD = "test-seed-definition"


def _tiny_workload(config: object) -> TorchWorkload:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    samples = TensorDataset(torch.zeros(32, 4), torch.zeros(32, dtype=torch.long))
    return TorchWorkload(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        samples,
        samples,
        batch_size=4,
        samples_per_shard=16,
        name="zeros",
    )


@pytest.fixture(scope="module", autouse=True)
def _registered() -> Iterator[None]:
    register(WORKLOAD, _tiny_workload, replace=True)
    yield


def _definition(path: Path, validators: list[str], max_updates: int = 2) -> Path:
    path.write_text(
        experiment_toml(
            validators=validators,
            reducers=[],
            quorum=2,
            workload={"name": WORKLOAD, "config": {"width": 4}},
            inner_steps=2,
            deadline_s=10.0,
            proposal_s=2.0,
            min_updates=1,
            max_updates=max_updates,
        )
    )
    return path


def _seed(data_dir: Path, definition: Path) -> Prepared:
    settings = NodeSettings(data_dir=data_dir, roles=("seed",), experiment_toml=definition)
    with DataDir(data_dir, exclusive=True) as datadir:
        return asyncio.run(prepare(settings, NodeStore(datadir)))


@pytest.fixture
def validators() -> list[str]:
    return [Identity.generate().public_key.hex() for _ in range(2)]


def test_the_same_definition_restarts_the_experiment(tmp_path: Path, validators: list[str]) -> None:
    original = _definition(tmp_path / "experiment.toml", validators)
    created = _seed(tmp_path / "seed", original)
    assert _seed(tmp_path / "seed", original).experiment.record_id == created.experiment.record_id
    # the same experiment written differently: a comment, the validators in another order
    text = original.read_text().replace(
        json.dumps(sorted(validators)), json.dumps(sorted(validators, reverse=True))
    )
    assert text != original.read_text()
    rewritten = tmp_path / "rewritten.toml"
    rewritten.write_text("# the same experiment\n" + text)
    assert _seed(tmp_path / "seed", rewritten).experiment.record_id == created.experiment.record_id


def test_another_definition_is_refused_naming_both_experiments(
    tmp_path: Path, validators: list[str]
) -> None:
    served = _seed(tmp_path / "seed", _definition(tmp_path / "a.toml", validators))
    other = _definition(tmp_path / "b.toml", validators, max_updates=3)
    with pytest.raises(LocalError) as refused:
        _seed(tmp_path / "seed", other)
    message = str(refused.value)
    found = re.fullmatch(
        rf"{tmp_path / 'seed'} follows experiment ([0-9a-f]{{64}}), not ([0-9a-f]{{64}}) defined "
        rf"by {other}; use a fresh --dir to create a new experiment, or restart with the original "
        r"--experiment-toml",
        message,
    )
    assert found is not None, message
    assert found[1] == served.experiment.record_id != found[2]


def test_a_definition_that_does_not_parse_is_refused(tmp_path: Path, validators: list[str]) -> None:
    served = _seed(tmp_path / "seed", _definition(tmp_path / "a.toml", validators))
    broken = tmp_path / "broken.toml"
    broken.write_text("quorum = [")
    with pytest.raises(LocalError, match=r"which .*broken\.toml does not define") as refused:
        _seed(tmp_path / "seed", broken)
    assert served.experiment.record_id in str(refused.value)
    assert "\n" not in str(refused.value)
