"""Hugging Face causal LMs as workloads and their export, on tiny GPT-2s built from configs
(nothing is downloaded)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from p2ptrain.errors import LocalError
from p2ptrain.torch.hf_causal_lm import (
    causal_lm_batch,
    causal_lm_workload,
    hf_causal_lm_workload,
    import_transformers,
)
from p2ptrain.torch.hf_export import write_hf_export
from p2ptrain.torch.registry import make_workload
from p2ptrain.torch.workload import TorchWorkload

transformers = pytest.importorskip("transformers")

TINY: dict[str, str | int | float | bool] = {
    "model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 16,
    "block_size": 16, "batch_size": 4, "val_blocks": 8, "lr": 0.01,
}  # fmt: skip


def _gpt2(vocab_size: int = 13, **extra: Any) -> Any:
    config = transformers.GPT2Config(
        vocab_size=vocab_size, n_layer=1, n_embd=16, n_head=2, n_positions=16,
        bos_token_id=None, eos_token_id=None, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_same_config_same_genesis_and_it_trains() -> None:
    first, second = hf_causal_lm_workload(TINY), hf_causal_lm_workload(TINY)
    genesis = first.initial_weights()
    assert genesis.keys() == second.initial_weights().keys()
    assert all(torch.equal(genesis[n], t) for n, t in second.initial_weights().items())
    other = hf_causal_lm_workload({**TINY, "seed": 1}).initial_weights()
    assert not torch.equal(genesis["transformer.wte.weight"], other["transformer.wte.weight"])
    assert first.language_model and first.vocab is not None
    assert len(first.vocab) == genesis["transformer.wte.weight"].shape[0]  # corpus vocabulary
    assert first.tied_parameters() == {"lm_head.weight": "transformer.wte.weight"}
    assert first.train_dataset[0].shape == (16,)  # rows of block_size token ids
    assert first.evaluate(genesis) == pytest.approx(math.log(len(first.vocab)), rel=0.1)
    result = first.train_window(genesis, range(64), steps=8, seed=0)
    assert result.loss_after < result.loss_before
    assert isinstance(make_workload("hf-causal-lm", TINY), TorchWorkload)


def test_tied_gpt2_weights_round_trip_through_a_full_state_dict() -> None:
    workload = hf_causal_lm_workload(TINY)
    trained = workload.train_window(workload.initial_weights(), range(32), steps=2, seed=0)
    state = workload.full_state_dict(trained.weights)
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    fresh = _gpt2(vocab_size=len(workload.vocab or ()), tie_word_embeddings=True)
    fresh.load_state_dict(state, strict=True)
    for name, param in fresh.named_parameters():
        assert torch.equal(param, trained.weights[name]), name


def test_bad_settings_say_what_to_do() -> None:
    with pytest.raises(LocalError, match="no setting 'n_layers'"):
        hf_causal_lm_workload({**TINY, "n_layers": 2})
    with pytest.raises(LocalError, match=r"never downloads.*HF_HUB_OFFLINE=1"):
        hf_causal_lm_workload({"pretrained": "openai-community/gpt2"})
    with pytest.raises(LocalError, match="either model_type"):
        hf_causal_lm_workload({"block_size": 16})
    with pytest.raises(LocalError, match="block_size 32 exceeds the model's 16 positions"):
        hf_causal_lm_workload({**TINY, "block_size": 32})
    with pytest.raises(LocalError, match="dtype must be one of"):
        hf_causal_lm_workload({**TINY, "dtype": "int8"})
    with pytest.raises(LocalError, match="must be of type int"):
        hf_causal_lm_workload({**TINY, "batch_size": "4"})


def test_a_missing_transformers_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(LocalError, match=r"pip install 'p2ptrain\[hf\]'"):
        import_transformers()


def test_a_bfloat16_model_trains_float32_master_weights() -> None:
    workload = hf_causal_lm_workload({**TINY, "dtype": "bfloat16"})
    assert workload.autocast_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in workload.model.parameters())
    result = workload.train_window(workload.initial_weights(), range(64), steps=6, seed=0)
    assert all(t.dtype == torch.float32 for t in result.weights.values())
    assert result.loss_after < result.loss_before


def _dict_rows(n: int, *, labels: bool, mask: bool) -> list[dict[str, torch.Tensor]]:
    rows = []
    for i in range(n):
        row = {"input_ids": (torch.arange(8) * (i % 4 + 1) + i) % 13}
        if mask:
            row["attention_mask"] = (torch.arange(8) < 8 - i % 3).long()
        if labels:
            row["labels"] = row["input_ids"].clone()
        rows.append(row)
    return rows


def test_causal_lm_rows_dicts_and_token_ids() -> None:
    batch = causal_lm_batch(_dict_rows(3, labels=False, mask=True))
    assert torch.equal(batch["labels"][2, -2:], torch.tensor([-100, -100]))
    assert torch.equal(batch["labels"][0], batch["input_ids"][0])
    ids = causal_lm_batch([torch.arange(5), torch.arange(5)])
    assert torch.equal(ids["input_ids"], ids["labels"])
    with pytest.raises(LocalError, match="an \\(x, y\\) pair is for TorchWorkload"):
        causal_lm_batch([(torch.arange(5), torch.arange(5))])
    for train in (_dict_rows(16, labels=False, mask=True), [torch.arange(8) % 13] * 16):
        workload = causal_lm_workload(
            _gpt2(), train, _dict_rows(4, labels=True, mask=False), batch_size=4,
            samples_per_shard=8, name="rows", lr=0.01, vocab=[chr(97 + i) for i in range(13)],
        )  # fmt: skip
        assert 0 < workload.dry_run() < 10
        result = workload.train_window(workload.initial_weights(), range(16), steps=4, seed=0)
        assert result.loss_after < result.loss_before
        assert workload.vocab is not None and workload.vocab[:2] == ("a", "b")
        assert len(workload.dataset_manifest().shards) == 2


def test_dry_run_names_an_hf_model_behind_a_plain_loss_fn() -> None:
    model = _gpt2()
    pairs = [(torch.arange(8) % 13, (torch.arange(8) + 1) % 13)] * 4
    workload = TorchWorkload(
        model, torch.optim.SGD(model.parameters(), lr=0.1), pairs, pairs, batch_size=2,
        samples_per_shard=4, name="pairs",
    )  # fmt: skip
    with pytest.raises(
        LocalError, match=r"returned CausalLMOutputWithCrossAttentions.*hf-causal-lm.*batch_loss"
    ):
        workload.dry_run()


def test_export_loads_with_from_pretrained_and_decodes(tmp_path: Path) -> None:
    workload = hf_causal_lm_workload(TINY)
    weights = workload.train_window(workload.initial_weights(), range(32), steps=2, seed=0).weights
    card = {"experiment": "exp-1", "head": "ab" * 8, "height": 7, "signers": ["v1", "v2"],
            "validation loss": 2.5}  # fmt: skip
    written = write_hf_export(workload, weights, tmp_path / "export", card)
    assert {"config.json", "model.safetensors", "vocab.json", "README.md"} <= set(written)
    assert all(Path(path).is_file() for path in written.values())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    for name, param in loaded.named_parameters():
        assert torch.equal(param, weights[name]), name
    table = json.loads(Path(written["vocab.json"]).read_text("utf-8"))
    token_of = {index: token for token, index in table.items()}
    assert len(token_of) == len(workload.vocab or ())
    ids = loaded.generate(torch.tensor([[0, 1]]), max_new_tokens=5, do_sample=False)
    text = "".join(token_of[i] for i in ids[0].tolist())
    assert len(text) == 7
    readme = Path(written["README.md"]).read_text("utf-8")
    assert "| height | 7 |" in readme and "| signers | v1, v2 |" in readme
    assert "AutoModelForCausalLM.from_pretrained" in readme
    # the card's usage runs as written (its sampling stays within the model's context)
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    snippet = snippet.replace('path = "."', f"path = {str(tmp_path / 'export')!r}")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet, "README.md", "exec"), {})  # the card's own usage code
    assert printed.getvalue().strip()
    # a peer can start from the export: the pretrained setting reads the local directory
    again = hf_causal_lm_workload({**{k: TINY[k] for k in ("block_size", "batch_size")},
                                   "pretrained": str(tmp_path / "export")})  # fmt: skip
    assert all(torch.equal(t, weights[n]) for n, t in again.initial_weights().items())
    with pytest.raises(LocalError, match="not an empty directory"):
        write_hf_export(workload, weights, tmp_path / "export", card)


def test_the_hf_format_needs_an_hf_model(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(13, 4), torch.nn.Linear(4, 13))
    rows = [torch.arange(8) % 13] * 4
    workload = TorchWorkload(
        model, torch.optim.SGD(model.parameters(), lr=0.1), rows, rows, batch_size=2,
        samples_per_shard=4, name="rows", batch_loss=lambda m, b: m(b).mean(),
    )  # fmt: skip
    with pytest.raises(LocalError, match="needs a Hugging Face model"):
        write_hf_export(workload, workload.initial_weights(), tmp_path / "out", {})


def test_whole_blocks_hash_stacked_like_row_by_row() -> None:
    from p2ptrain.data.shakespeare import ShakespeareChars
    from p2ptrain.data.shards import sample_bytes, shard_blob_id
    from p2ptrain.torch.hf_causal_lm import _WholeBlocks

    rows = _WholeBlocks(ShakespeareChars(15))
    digest = hashlib.sha256(b"p2ptrain/v1/shard\n")
    for index in range(100, 300):
        for piece in sample_bytes(rows[index], index):
            digest.update(piece)
    assert shard_blob_id(rows, 100, 300) == digest.hexdigest()
