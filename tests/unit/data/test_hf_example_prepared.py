"""The Hugging Face example's training split, a ``datasets.Dataset``, through prepare: the
prepared shards hold the same rows, and the example's workload with ``prepared = true``
builds without training data of its own."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from p2ptrain.data.prepare import read_prepared
from p2ptrain.data.shard_format import open_shard

pytest.importorskip("transformers")
# found, not imported (pyarrow and pandas cost every worker seconds of collection)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None,
    reason="datasets is not installed (pip install 'p2ptrain[hf]')",
)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hf_gpt2"


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(EXAMPLE))
    try:
        spec = importlib.util.spec_from_file_location(f"hf_example_{name}", EXAMPLE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLE))


def test_the_examples_dataset_prepares_into_the_same_rows(tmp_path: Path) -> None:
    prepare_data = _load("prepare_data")
    prepare_data.main(tmp_path / "prepared")
    prepared = read_prepared(tmp_path / "prepared", verify=True)
    workload = _load("workload")
    train, _ = workload.splits(workload.DEFAULTS)
    rows = workload.blocks(train, int(workload.DEFAULTS["block_size"]))
    assert prepared.manifest.kind == "sharded"
    assert prepared.manifest.total_samples == len(rows)
    last = prepared.manifest.shards[-1]
    shard = open_shard(prepared.shard_path(last.name), shard=last.name)
    assert torch.equal(shard[len(shard) - 1]["input_ids"], rows[len(rows) - 1]["input_ids"])
    built = workload.workload({"prepared": True})
    assert built.data is None
    built.dry_run()  # stands in with the validation rows


def test_the_examples_vocab_size_pads_the_embedding_and_never_cuts_the_text() -> None:
    workload = _load("workload")
    small = {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16, "chars": 4000}
    padded = workload.workload({**small, "vocab_size": 500})
    assert padded.model.config.vocab_size == 500
    padded.dry_run()
    with pytest.raises(ValueError, match="vocab_size 10 is below the text's"):
        workload.workload({**small, "vocab_size": 10})
