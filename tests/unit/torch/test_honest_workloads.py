"""Built-in workloads are honest about the user's prepared data: a text whose alphabet is not
Shakespeare's, prepared with the ``chars`` tokenizer and a validation split, trains
``hf-causal-lm`` and ``char-gpt`` with the dataset's vocabulary; the validation loss the
workload reports is an independent evaluation of the exported model on the prepared
validation split (read with safetensors and transformers alone), ``vocab.json`` decodes the
dataset's ids back into its text, and what a workload cannot honour is refused in words."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from p2ptrain.core.encoding import decode, encode
from p2ptrain.core.manifests import DatasetManifest, ShardInfo
from p2ptrain.data.holdout import HoldOut, held_out_mask
from p2ptrain.data.pipelines import ShardedData
from p2ptrain.data.prepare import PreparedDataset, prepare_dataset, read_prepared
from p2ptrain.data.shakespeare import ShakespeareChars
from p2ptrain.errors import LocalError
from p2ptrain.node.data_import import attach_validation, import_prepared
from p2ptrain.protocol.leases import lease_for
from p2ptrain.store.blobs import BlobStore
from p2ptrain.torch.hf_export import write_hf_export
from p2ptrain.torch.registry import make_workload
from p2ptrain.torch.workload import TorchWorkload
from tests.support import builders

transformers = pytest.importorskip("transformers")

BLOCK = 17  # tokens per row
ALPHABET = "αβγδεζηθικλμνξοπρστυφχψω ΑΒΓΔ{}~#@^0123456789\n"
TINY_GPT2: dict[str, str | int | float | bool] = {
    "model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 32,
    "batch_size": 4, "lr": 0.01,
}  # fmt: skip


@pytest.fixture(scope="module")
def greek(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, PreparedDataset]:
    """About 8000 characters of an alphabet the Shakespeare corpus does not use, prepared
    with the chars tokenizer, a fifth held out for validation (seed 7)."""
    root = tmp_path_factory.mktemp("greek")
    rng = random.Random(7)
    text = "".join(rng.choice(ALPHABET) for _ in range(8000))
    (root / "greek.txt").write_text(text, "utf-8")
    prepared = prepare_dataset(
        root / "greek.txt", root / "prepared", block_size=BLOCK, tokenizer="chars",
        samples_per_shard=64, val_fraction=0.2,
    )  # fmt: skip
    return text, prepared


def _attached(workload: Any, prepared: PreparedDataset) -> TorchWorkload:
    assert isinstance(workload, TorchWorkload)
    workload.use_data(ShardedData(prepared.manifest, lambda shard: prepared.shard_path(shard.name)))
    return workload


def _validation_ids(prepared: PreparedDataset) -> torch.Tensor:
    """Every validation row, read from the shard files with safetensors alone."""
    rows = [
        load_file(str(prepared.shard_path(shard.name)))["input_ids"].long()
        for shard in prepared.manifest.validation
    ]
    return torch.cat(rows)


def _trained(workload: TorchWorkload) -> dict[str, torch.Tensor]:
    weights = workload.initial_weights()
    for window in range(2):
        indices = list(range(window * 50, window * 50 + 50))
        weights = workload.train_window(weights, indices, steps=6, seed=window).weights
    return weights


def test_the_split_holds_out_evenly_spread_rows() -> None:
    ratio = HoldOut(0.3).ratio
    assert np.flatnonzero(held_out_mask(0, 10, ratio)).tolist() == [3, 6, 9]
    assert np.flatnonzero(held_out_mask(0, 30, HoldOut(0.1).ratio)).tolist() == [9, 19, 29]
    with pytest.raises(LocalError, match=r"between 0 and 1"):
        HoldOut(1.0)


def test_prepare_records_the_split_and_the_vocabulary(
    greek: tuple[str, PreparedDataset],
) -> None:
    text, prepared = greek
    manifest = prepared.manifest
    rows = len(text) // BLOCK
    assert manifest.validation_samples == rows // 5
    assert manifest.total_samples == rows - rows // 5
    assert [s.name for s in manifest.validation] == ["greek-val-00000", "greek-val-00001"]
    assert manifest.tokenizer is not None and manifest.tokenizer.kind == "chars"
    assert manifest.tokenizer.vocab == "".join(sorted(set(text)))
    assert manifest.tokenizer.block_size == BLOCK
    assert read_prepared(prepared.path, verify=True).manifest == manifest
    # leases take training shards only
    experiment = msgspec.structs.replace(
        builders.experiment([builders.identity(1)], 1), dataset=manifest, lease_size=100
    )
    leased = {
        name
        for window in range(1, 30)
        for peer in ("a", "b", "c")
        for name, _, _ in lease_for(experiment, window, peer).parts
    }
    assert leased and not leased & {s.name for s in manifest.validation}


def test_hf_causal_lm_reports_the_exported_models_loss_on_the_prepared_split(
    greek: tuple[str, PreparedDataset], tmp_path: Path
) -> None:
    text, prepared = greek
    tokenizer = prepared.manifest.tokenizer
    assert tokenizer is not None and set(tokenizer.vocab) != set(ShakespeareChars(8).vocab)
    workload = _attached(
        make_workload("hf-causal-lm", TINY_GPT2, dataset=prepared.manifest), prepared
    )
    assert workload.model.config.vocab_size == tokenizer.vocab_size
    assert workload.validation_samples == prepared.manifest.validation_samples
    assert workload.dry_run() > 0
    weights = _trained(workload)
    reported = workload.evaluate(weights)
    out = tmp_path / "model-hf"
    write_hf_export(workload, weights, out, {"experiment": "greek"})
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _validation_ids(prepared)
    with torch.no_grad():
        independent = float(model(input_ids=ids, labels=ids).loss)
    assert reported == pytest.approx(independent, abs=1e-4)
    table = json.loads((out / "vocab.json").read_text("utf-8"))
    assert table == {char: index for index, char in enumerate(tokenizer.vocab)}
    token_of = {index: char for char, index in table.items()}
    # the first held-out row (F = 1/5) is source row 4: its text, decoded from its ids
    assert "".join(token_of[i] for i in ids[0].tolist()) == text[4 * BLOCK : 5 * BLOCK]
    assert "chars, " in (out / "README.md").read_text("utf-8")


def test_char_gpt_validates_on_the_prepared_split(greek: tuple[str, PreparedDataset]) -> None:
    _, prepared = greek
    config = {"n_layer": 1, "n_embd": 16, "n_head": 2, "batch_size": 4}
    workload = _attached(make_workload("char-gpt", config, dataset=prepared.manifest), prepared)
    tokenizer = prepared.manifest.tokenizer
    assert tokenizer is not None and workload.vocab == tuple(tokenizer.vocab)
    model = workload.model
    weights = _trained(workload)
    reported = workload.evaluate(weights)
    ids = _validation_ids(prepared)
    model.eval()
    with torch.no_grad():
        logits = model(ids[:, :-1])
        independent = float(
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        )
    assert reported == pytest.approx(independent, abs=1e-4)


def test_without_a_split_there_is_no_validation_loss_and_it_says_why(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("ΑΒΓ αβγ δεζ " * 40, "utf-8")
    prepared = prepare_dataset(tmp_path / "t.txt", tmp_path / "p", block_size=9, tokenizer="chars")
    workload = _attached(
        make_workload("hf-causal-lm", TINY_GPT2, dataset=prepared.manifest), prepared
    )
    assert workload.validation_samples == 0
    assert "--val-fraction" in (workload.validation_missing or "")
    with pytest.raises(LocalError, match=r"no validation loss: .*no validation split"):
        workload.evaluate(workload.initial_weights())
    assert workload.dry_run() > 0  # on the training rows


def test_what_a_workload_cannot_honour_is_refused(
    greek: tuple[str, PreparedDataset], tmp_path: Path
) -> None:
    _, prepared = greek
    dataset = prepared.manifest
    with pytest.raises(LocalError, match=r"block_size = 32.*rows of 17 tokens"):
        make_workload("hf-causal-lm", {**TINY_GPT2, "block_size": 32}, dataset=dataset)
    with pytest.raises(LocalError, match=r"vocab_size 10 is below the 46 ids of .* 'greek'"):
        make_workload("hf-causal-lm", {**TINY_GPT2, "vocab_size": 10}, dataset=dataset)
    with pytest.raises(LocalError, match=r"corpus = 'shakespeare' names the built-in data"):
        make_workload("hf-causal-lm", {**TINY_GPT2, "corpus": "shakespeare"}, dataset=dataset)
    with pytest.raises(LocalError, match=r"block_size = 64, .*context of 16 .*--block-size 65"):
        make_workload("char-gpt", {"block_size": 64}, dataset=dataset)
    np.save(tmp_path / "ids.npy", np.zeros((8, 4), dtype=np.int64))
    numbers = prepare_dataset(tmp_path / "ids.npy", tmp_path / "n", samples_per_shard=4)
    with pytest.raises(LocalError, match=r"records no tokenizer"):
        make_workload("char-gpt", {}, dataset=numbers.manifest)


def test_an_evaluator_reads_the_split_from_its_blob_store(
    greek: tuple[str, PreparedDataset], tmp_path: Path
) -> None:
    _, prepared = greek
    config = {"n_layer": 1, "n_embd": 8, "n_head": 2, "batch_size": 4}
    local = _attached(make_workload("char-gpt", config, dataset=prepared.manifest), prepared)
    evaluator = make_workload("char-gpt", config, dataset=prepared.manifest)
    blobs = BlobStore(tmp_path / "blobs")
    assert attach_validation(evaluator, prepared.manifest, blobs) is None  # the split exists
    with pytest.raises(LocalError, match=r"greek-val-00000 .* not on this machine"):
        evaluator.evaluate(evaluator.initial_weights())
    import_prepared(blobs, prepared)  # what fetching the validation shards leaves
    weights = local.initial_weights()
    assert evaluator.evaluate(weights) == local.evaluate(weights)
    # without a split, the node refuses to evaluate at start, saying why
    (tmp_path / "t.txt").write_text("αβγ δεζ\n" * 30, "utf-8")
    bare = prepare_dataset(tmp_path / "t.txt", tmp_path / "p", block_size=8)
    workload = make_workload("char-gpt", config, dataset=bare.manifest)
    assert "--val-fraction" in (attach_validation(workload, bare.manifest, blobs) or "")


def test_an_old_dataset_manifest_encodes_and_decodes_as_before() -> None:
    shard = {"name": "d-00000", "blob_id": "ab" * 32, "samples": 3, "bytes": 7}
    for kind in ("indexed", "sharded"):
        before = msgspec.msgpack.encode({"name": "d", "shards": [shard], "kind": kind})
        dataset = decode(DatasetManifest, before, max_bytes=1 << 10)
        assert dataset.validation == () and dataset.tokenizer is None
        assert encode(dataset) == before
    default = DatasetManifest(name="d", shards=(ShardInfo(**shard),))  # type: ignore[arg-type]
    assert default.kind == "indexed" and b"indexed" in encode(default)


def test_the_demo_dry_runs_before_it_times_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from p2ptrain.cli.demo_command import run_demo
    from p2ptrain.node import local_network

    code = tmp_path / "small_vocab.py"
    code.write_text(
        "import torch\n"
        "def workload():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Flatten(),\n"
        "                                torch.nn.Linear(12, 5))\n"
        "    rows = [(torch.tensor([1, 2, 40]), torch.tensor(1)) for _ in range(8)]\n"
        "    return {'model': model, 'train': rows, 'val': rows, 'batch_size': 2}\n"
    )

    def timed(workload: Any) -> float:
        raise AssertionError("the timing probe ran before the dry run")

    monkeypatch.setattr(local_network, "seconds_per_step", timed)
    args = argparse.Namespace(
        windows=1, trainers=2, inner_steps=1, staleness=0, workdir=str(tmp_path / "demo"),
        workload=f"{code}:workload", experiment_toml=None, json=True, no_baseline=True,
    )  # fmt: skip
    with pytest.raises(LocalError, match=r"dry run.*IndexError"):
        run_demo(args)
