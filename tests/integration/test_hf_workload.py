"""A Hugging Face GPT-2 of the user's own on a real network: the seed signs the workload by
reference (examples/hf_gpt2), one trainer runs it through the CLI and one through the Trainer
API; the certified model exports as a from_pretrained directory and as a state dict that
loads with strict=True; a trainer whose model has one layer of another size is refused with
the parameter's name."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import tomli_w
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from p2ptrain import Trainer
from p2ptrain.node.export import canonical_weights
from tests.support.local_net import Net, new_net

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.integration,
    # found, not imported: importing datasets (pyarrow, pandas) costs every worker seconds
    # of collection; the example imports it when a test runs
    pytest.mark.skipif(
        importlib.util.find_spec("datasets") is None,
        reason="datasets is not installed (pip install 'p2ptrain[hf]')",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_gpt2" / "workload.py"
REFERENCE = f"{EXAMPLE}:workload"
#: A GPT-2 of ~30k parameters on 60k characters: a window of 10 steps takes ~0.1 s.
CONFIG = {
    "n_layer": 1,
    "n_embd": 32,
    "n_head": 2,
    "block_size": 32,
    "chars": 60_000,
    "batch_size": 4,
    "samples_per_shard": 32,
}
WINDOWS = 3


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hf_gpt2_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _experiment(net: Net) -> Path:
    tables: dict[str, Any] = {
        "study": "hf-test",
        "name": "gpt2-tiny",
        "inner_steps": 10,
        "validators": [net.network.identity("validator-0")],
        "reducers": [],
        "quorum": 1,
        "workload": {"reference": REFERENCE, "config": CONFIG},
        "inner_optimizer": {"name": "adamw", "lr": 3e-3},
        "window": {"deadline_s": 30.0, "proposal_s": 3.0, "min_updates": 2, "max_updates": 2},
    }
    path = net.workdir / "experiment.toml"
    path.write_text(tomli_w.dumps(tables))
    return path


class _ApiTrainer:
    """The Trainer API on a thread: the user's own model, datasets and loss."""

    def __init__(self, net: Net) -> None:
        seed = net.network.seed
        assert seed is not None and seed.address is not None
        assert net.network.experiment_id is not None
        from p2ptrain.torch.hf_causal_lm import causal_lm_batch, causal_lm_loss

        parts = _example().workload(CONFIG)  # what the user builds: model, data
        self.trainer = Trainer(
            data_dir=net.workdir / "api-trainer",
            experiment=net.network.experiment_id,
            bootstrap=[seed.address],
            model=parts.model,
            optimizer=parts.optimizer,
            train_loader=DataLoader(
                parts.train_dataset, batch_size=CONFIG["batch_size"], collate_fn=causal_lm_batch
            ),
            batch_loss=causal_lm_loss,
        )
        self.outcomes: list[Any] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.outcomes.extend(self.trainer.run(windows=WINDOWS))
        except BaseException as exc:  # handed to the test
            self.error = exc


@pytest.fixture(scope="module")
def hf_net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Net, _ApiTrainer]]:
    net = new_net(tmp_path_factory.mktemp("hf"))
    try:
        path = _experiment(net)
        net.start("seed", "seed", args=["--experiment-toml", str(path), "--archive"])
        net.wait_ready(["seed"])
        net.start("validator-0", "validator")
        net.start("trainer-0", "trainer", windows=WINDOWS, args=["--workload", REFERENCE])
        api = _ApiTrainer(net)
        net.wait_ready(["validator-0", "trainer-0"])
        net.wait_height("seed", WINDOWS, 120)
        api.thread.join(timeout=60)
        yield net, api
    finally:
        net.close()


def test_both_trainers_certify_windows(hf_net: tuple[Net, _ApiTrainer]) -> None:
    net, api = hf_net
    assert api.error is None, repr(api.error)
    assert [o.height for o in api.outcomes] == list(range(1, WINDOWS + 1))
    # both updates were in every window (min_updates = max_updates = 2)
    assert all(o.accepted == 2 and o.update == "accepted" for o in api.outcomes), api.outcomes
    manifest, *_ = canonical_weights(net.data_dir("seed"))
    assert manifest.workload.reference == REFERENCE
    assert manifest.workload.name == "hf_gpt2.workload"
    assert manifest.workload.batch_size == CONFIG["batch_size"]
    first, last = api.outcomes[0], api.outcomes[-1]
    assert last.loss_after is not None and first.loss_before is not None
    assert last.loss_after < first.loss_before


def test_exports_load_with_from_pretrained_and_strict(hf_net: tuple[Net, _ApiTrainer]) -> None:
    net, _api = hf_net
    seed_dir = net.data_dir("seed")
    _manifest, _id, height, head_id, weights = canonical_weights(seed_dir)
    out = net.workdir / "export-hf"
    done = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "export", "--dir", str(seed_dir), "--format", "hf",
         "--out", str(out), "--workload", REFERENCE, "--json"],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["head_id"] == head_id
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    loaded = dict(model.named_parameters())
    for name, value in weights.items():
        assert torch.equal(loaded[name].detach(), value), name
    card = (out / "README.md").read_text()
    assert head_id in card and str(height) in card
    vocab = json.loads((out / "vocab.json").read_text())
    characters = {index: char for char, index in vocab.items()}
    generated = model.generate(torch.tensor([[vocab["T"]]]), max_new_tokens=8, do_sample=False)
    assert len("".join(characters[int(i)] for i in generated[0])) == 9
    # the plain export: the whole state dict, loaded strictly into the user's own module
    plain = net.workdir / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "export", "--dir", str(seed_dir), "--out", str(plain),
         "--workload", REFERENCE],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    mine = _example().workload(CONFIG).model
    mine.load_state_dict(load_file(plain), strict=True)
    assert torch.equal(mine.transformer.wte.weight, weights["transformer.wte.weight"])


def test_a_trainer_with_another_layer_size_is_refused(
    hf_net: tuple[Net, _ApiTrainer], tmp_path: Path
) -> None:
    net, _api = hf_net
    # the example's model with one layer of another size: the MLP's inner width (n_inner)
    other = tmp_path / "wider.py"
    other.write_text(
        "import importlib.util\n"
        "import transformers\n"
        f"spec = importlib.util.spec_from_file_location('example', {str(EXAMPLE)!r})\n"
        "example = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(example)\n"
        "class WiderConfig(transformers.GPT2Config):\n"
        "    def __init__(self, **settings):\n"
        "        super().__init__(**settings, n_inner=48)\n"
        "example.transformers = type('T', (), {'GPT2Config': WiderConfig,\n"
        "    'GPT2LMHeadModel': transformers.GPT2LMHeadModel})\n"
        "workload = example.workload\n"
    )
    seed = net.network.seed
    assert seed is not None and seed.address is not None
    done = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "train", "--dir", str(tmp_path / "wider-trainer"),
         "--experiment", str(net.network.experiment_id), "--bootstrap", seed.address,
         "--listen", "none", "--workload", f"{other}:workload"],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "parameter 'transformer.h.0.mlp.c_fc.bias'" in done.stderr, done.stderr
    assert "(48,) locally, (128,) in the experiment" in done.stderr, done.stderr
