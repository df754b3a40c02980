"""The prepared validation split over a real network: a seed serves a prepared text (an
alphabet Shakespeare's lacks, ``chars`` tokenizer, a fifth held out), a trainer trains the
built-in char-GPT on it without ever holding a validation shard, and a validator started with
``--evaluate`` fetches the validation shards by hash and reports, for the last head, the loss
an independent evaluation of that head on the split's shard files gives.

One short network: a seed, ``validator-0`` (``--evaluate``, q = 1) and ``trainer-0`` for
:data:`WINDOWS` windows (seed 11 for the text).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import torch
from safetensors.torch import load_file

from p2ptrain.data.prepare import PreparedDataset, prepare_dataset
from p2ptrain.node.export import canonical_weights
from p2ptrain.store.datadir import DataDir
from p2ptrain.torch.char_gpt import CharGPT
from tests.support.local_net import INNER_STEPS, TINY_CONFIG, Net, new_net

pytestmark = pytest.mark.integration

WINDOWS = 2
ALPHABET = "αβγδεζηθικλμνξοπρστυφχψω ΑΒΓΔ{}~#@^0123456789\n"
#: The workload's settings but its context, which the prepared rows (33 tokens) give.
CONFIG = {k: v for k, v in TINY_CONFIG.items() if k != "block_size"}


def _prepare(workdir: Path) -> PreparedDataset:
    rng = random.Random(11)
    (workdir / "greek.txt").write_text("".join(rng.choice(ALPHABET) for _ in range(8000)))
    return prepare_dataset(
        workdir / "greek.txt", workdir / "prepared", block_size=33, tokenizer="chars",
        samples_per_shard=64, val_fraction=0.2,
    )  # fmt: skip


def _experiment(net: Net, prepared: PreparedDataset) -> Path:
    tables: dict[str, Any] = {
        "study": "validation-test",
        "name": "greek",
        "inner_steps": INNER_STEPS,
        "validators": [net.network.identity("validator-0")],
        "reducers": [],
        "quorum": 1,
        "workload": {"name": "char-gpt", "config": CONFIG},
        "inner_optimizer": {"name": "adamw", "lr": float(CONFIG["lr"])},
        "window": {"deadline_s": 30.0, "proposal_s": 3.0, "min_updates": 1, "max_updates": 1},
        "data": {"prepared": str(prepared.path)},
    }
    path = net.workdir / "experiment.toml"
    path.write_text(tomli_w.dumps(tables))
    return path


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Net, PreparedDataset]]:
    workdir = tmp_path_factory.mktemp("prepared-validation")
    prepared = _prepare(workdir)
    net = new_net(workdir)
    try:
        net.start("seed", "seed", args=["--experiment-toml", str(_experiment(net, prepared))])
        net.wait_ready(["seed"])
        net.start("validator-0", "validator", args=["--evaluate"])
        net.start("trainer-0", "trainer", windows=WINDOWS)
        net.wait_ready(["validator-0", "trainer-0"])
        net.wait_event(
            f"validator-0 to evaluate head {WINDOWS}",
            120,
            lambda n, e: (
                n == "validator-0" and e["event"] == "evaluated" and e["height"] == WINDOWS
            ),
        )
        net.stop(["trainer-0", "validator-0", "seed"])
        yield net, prepared
    finally:
        net.close()


def test_the_evaluator_reports_the_loss_on_the_prepared_split(
    evaluated: tuple[Net, PreparedDataset],
) -> None:
    net, prepared = evaluated
    [event] = [e for e in net.events("evaluated", "validator-0") if e["height"] == WINDOWS]
    tokenizer = prepared.manifest.tokenizer
    assert tokenizer is not None
    ids = torch.cat(
        [
            load_file(str(prepared.shard_path(s.name)))["input_ids"].long()
            for s in prepared.manifest.validation
        ]
    )
    assert event["samples"] == len(ids) == prepared.manifest.validation_samples
    *_, height, head_id, weights = canonical_weights(net.data_dir("validator-0"))
    assert (height, head_id) == (WINDOWS, event["head_id"])
    model = CharGPT(
        tokenizer.vocab_size, n_layer=1, n_embd=32, n_head=2, block_size=tokenizer.block_size - 1
    )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"head.weight"}  # tied to the embedding
    with torch.no_grad():
        logits = model.eval()(ids[:, :-1])
        independent = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    assert event["loss"] == pytest.approx(float(independent), abs=1e-4)
    # the validator fetched the validation shards; the trainer never held one
    validation = [s.blob_id for s in prepared.manifest.validation]
    with DataDir(net.data_dir("validator-0")) as validator:
        assert all(validator.blobs.has(blob) for blob in validation)
    with DataDir(net.data_dir("trainer-0")) as trainer:
        assert not any(trainer.blobs.has(blob) for blob in validation)
    assert not net.events("role_error")
