"""The Python Trainer API against real node processes; `p2ptrain status` over HTTP and
`export`; a private network, with a viewer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset

from p2ptrain import Trainer
from p2ptrain.errors import LocalError
from p2ptrain.node.export import canonical_weights
from p2ptrain.torch.char_gpt import char_gpt_workload
from tests.support.local_net import (  # noqa: F401
    TINY_CONFIG,
    Net,
    local_net,
)

pytestmark = pytest.mark.integration


class _ThreadsSeen(Dataset[object]):
    """A dataset that notes the torch thread count of the thread that reads it (the one that
    trains, as the loader has no workers)."""

    def __init__(self, inner: Dataset[object]) -> None:
        self.inner, self.threads = inner, set[int]()

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> object:
        self.threads.add(torch.get_num_threads())
        return self.inner[index]


def test_a_user_model_trains_through_the_trainer_api(local_net: Net) -> None:  # noqa: F811
    # The seed and one validator (q = 1) are processes; the trainer is this test's thread.
    local_net.launch(validators=1, reducers=0, trainers=0, quorum=1, max_updates=1)
    address = local_net.network.seed.address if local_net.network.seed else None
    assert address is not None and local_net.network.experiment_id is not None
    parts = char_gpt_workload(TINY_CONFIG)  # the same model and data a user would build
    seen = _ThreadsSeen(parts.train_dataset)
    train_loader = DataLoader(seen, batch_size=parts.batch_size, shuffle=True)
    val_loader = DataLoader(parts.val_dataset, batch_size=64)
    trainer = Trainer(
        data_dir=local_net.workdir / "api-trainer",
        experiment=local_net.network.experiment_id,
        bootstrap=[address],
        model=parts.model,
        optimizer=parts.optimizer,
        train_loader=train_loader,
        val_loader=val_loader,
    )
    seen.threads.clear()  # what the Trainer's dry run (this thread) read
    outcomes = list(trainer.run(windows=2))
    assert [o.height for o in outcomes] == [1, 2]
    assert all(o.accepted == 1 and o.update == "accepted" for o in outcomes)
    assert outcomes[-1].loss_after is not None and outcomes[-1].bytes_sent > 0
    # every window trained on the node's one torch thread (threads=1), whichever worker
    # thread it ran in, including the one that had built the genesis weights before
    assert seen.threads == {1}
    # the certified heads are what the seed holds
    local_net.wait_height("seed", 2, 30)
    status = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "status", address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    seed = json.loads(status.stdout)
    # no trainer is left after ours stopped at 2, so the network stays there
    assert seed["roles"] == ["seed"] and seed["height"] == 2
    assert seed["head_id"] == outcomes[-1].head_id
    # the exported checkpoint is the certified model, loadable into the user's model
    out = local_net.workdir / "export" / "model.safetensors"
    trainer_dir = str(local_net.workdir / "api-trainer")
    exported = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "export", "--dir", trainer_dir, "--out", str(out),
         "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    summary = json.loads(exported.stdout)
    assert summary["height"] == 2 and summary["head_id"] == outcomes[-1].head_id
    with safe_open(str(out), framework="pt") as handle:
        assert handle.metadata()["head_id"] == outcomes[-1].head_id
    weights = load_file(str(out))
    _missing, unexpected = parts.model.load_state_dict(weights, strict=False)
    assert not unexpected and json.loads(out.with_suffix(".json").read_text())["height"] == 2
    # windows=N trains N more windows from where the trainer stands, not up to height N
    assert [o.height for o in trainer.run(windows=1)] == [3]
    with pytest.raises(LocalError, match=r"trained nothing: nothing to do: already at height 3"):
        list(trainer.run(until_height=3))


def test_a_model_that_is_not_the_experiments_is_refused(local_net: Net) -> None:  # noqa: F811
    local_net.launch(validators=1, reducers=0, trainers=0, quorum=1, max_updates=1)
    address = local_net.network.seed.address if local_net.network.seed else None
    assert address is not None and local_net.network.experiment_id is not None
    other = char_gpt_workload({**TINY_CONFIG, "n_embd": 48})  # another width
    trainer = Trainer(
        data_dir=local_net.workdir / "wrong-trainer",
        experiment=local_net.network.experiment_id,
        bootstrap=[address],
        model=other.model,
        optimizer=other.optimizer,
        train_loader=DataLoader(other.train_dataset, batch_size=8),
        val_loader=DataLoader(other.val_dataset, batch_size=8),
    )
    with pytest.raises(
        LocalError, match=r"parameter 'blocks.0.fc.bias' has shape \(192,\) locally"
    ):
        list(trainer.run(windows=1))


def test_a_private_network_admits_only_nodes_with_its_secret(local_net: Net) -> None:  # noqa: F811
    net = local_net
    secret = net.workdir / "net.secret"  # the seed writes a new one
    path = net.write_experiment(validators=["validator-0"], quorum=1, max_updates=1)
    net.start("seed", "seed", args=["--experiment-toml", str(path), "--secret-file", str(secret)])
    net.wait_ready(["seed"])
    assert secret.stat().st_mode & 0o777 == 0o600
    net.start("validator-0", "validator", args=["--secret-file", str(secret)])
    net.start("trainer-0", "trainer", windows=2, args=["--secret-file", str(secret)])
    # a viewer follows the chain and keeps the canonical model, serving nothing
    net.start("viewer-0", "viewer", windows=2, args=["--secret-file", str(secret)])
    net.wait_ready(["validator-0", "trainer-0", "viewer-0"])
    net.wait_height("seed", 2, 60)
    net.wait_exits(["viewer-0"], 60)
    manifest, _experiment, height, head_id, _weights = canonical_weights(net.data_dir("viewer-0"))
    assert height == 2 and net.status("viewer-0")["address"] is None
    # one chain (the seed's adoption event, not its status file: that is rewritten a
    # moment later)
    seed_heads = {e["height"]: e["head_id"] for e in net.events("adopted", "seed")}
    assert seed_heads[2] == head_id and manifest.quorum == 1
    seed = net.network.seed
    assert seed is not None and seed.address is not None and net.network.experiment_id
    outsider = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "train", "--dir", str(net.workdir / "outsider"),
         "--bootstrap", seed.address, "--experiment", net.network.experiment_id],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert outsider.returncode == 2, outsider.stderr
    assert "give this node its network secret" in outsider.stderr
