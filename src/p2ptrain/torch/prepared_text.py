"""What the built-in language models (``char-gpt``, ``hf-causal-lm``) take from prepared text.

When an experiment trains on a prepared dataset (``[data] prepared = "DIR"``), every peer
builds the built-in workload from the experiment's dataset manifest, which records how the
text was tokenized (``dataset.tokenizer``: kind, vocabulary size, the characters of a
``chars`` vocabulary, tokens per row). The workload then

* sizes the model's vocabulary (and context) from it, so no token id is out of range;
* keeps the tokenizer (and a ``chars`` vocabulary) for exports, never the built-in corpus's;
* trains on the prepared rows (``{"input_ids": int64[block_size]}``), which the node attaches;
* validates on the dataset's validation split (``data prepare --val-fraction``) and on
  nothing else: without a split it reports no validation loss and says why.

A dataset that does not record a tokenizer (not text, or prepared by an older p2ptrain) is
refused with what to do, as is a setting the prepared rows contradict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2ptrain.core.manifests import DatasetManifest, TokenizerSpec
from p2ptrain.data.pipelines import ShardedData
from p2ptrain.errors import LocalError

__all__ = ["PreparedText", "prepared_text"]

#: Rows of the data's form that a trainer's dry run uses when no prepared row is on its
#: machine yet.
_EXAMPLE_ROWS = 4


@dataclass(frozen=True)
class PreparedText:
    """The experiment's prepared text dataset, as a built-in workload sees it."""

    dataset: DatasetManifest
    tokenizer: TokenizerSpec

    @property
    def pipeline(self) -> ShardedData:
        """The dataset's shards, none of them located yet (the node attaches them)."""
        return ShardedData(self.dataset, lambda shard: None)

    def example_rows(self) -> list[dict[str, torch.Tensor]]:
        """A few rows of the data's form (token ids below the vocabulary size)."""
        size, length = self.tokenizer.vocab_size, self.tokenizer.block_size
        steps = torch.arange(length, dtype=torch.int64)
        return [{"input_ids": (steps * 7 + row) % size} for row in range(_EXAMPLE_ROWS)]


def prepared_text(
    dataset: DatasetManifest | None, workload: str, config: dict[str, object]
) -> PreparedText | None:
    """The prepared text ``dataset`` a built-in workload trains on (None: the experiment
    names no prepared data, the workload uses its built-in corpus); a LocalError when the
    dataset or the config ``workload`` was given cannot be honoured."""
    if dataset is None or dataset.kind != "sharded":
        return None
    tokenizer = dataset.tokenizer
    if tokenizer is None:
        raise LocalError(
            f"{workload} trains on text, and the prepared dataset {dataset.name!r} records no "
            "tokenizer (it was not prepared from text, or by an older p2ptrain): prepare "
            "text with p2ptrain data prepare SOURCE --out DIR --block-size L [--tokenizer "
            "chars] [--val-fraction 0.1], or train your own workload on it (--workload)"
        )
    if "corpus" in config:
        raise LocalError(
            f"{workload}: corpus = {config['corpus']!r:.40} names the built-in data, but the "
            f"experiment trains on the prepared dataset {dataset.name!r}: drop corpus from "
            "[workload.config], or drop [data] to train on the built-in corpus"
        )
    return PreparedText(dataset, tokenizer)
