"""A tiny next-token model over token rows, and the token data the sharded-data tests prepare.

``workload(config)`` is a user's factory (passed by reference: ``tests/support/token_lm.py:
workload``): an embedding and a linear head over ``{"input_ids": [L]}`` rows, trained on the
experiment's prepared shards (``train`` is None: the node attaches them) and validated on rows
made by :func:`token_rows` with another seed. :func:`token_rows` makes rows a model can learn:
each token is the one before plus a step drawn per row (mod the vocabulary).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

VOCAB = 64


def token_rows(rows: int, length: int, seed: int) -> np.ndarray:
    """``rows`` int32 rows of ``length`` tokens: ``t[i+1] = t[i] + step (mod VOCAB)``."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, size=(rows, 1), dtype=np.int32)
    step = rng.integers(1, 4, size=(rows, 1), dtype=np.int32)
    tokens = start + step * np.arange(length, dtype=np.int32)
    tokens %= VOCAB
    return tokens


class TokenLM(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        here = self.embed(ids[:, 1:])
        before = self.embed(ids[:, :-1])
        return self.head(torch.relu(self.mix(torch.cat([here, before], dim=-1))))


def _ids(batch: Any) -> torch.Tensor:
    ids = batch["input_ids"] if isinstance(batch, Mapping) else batch
    return ids.long()


def loss(model: nn.Module, batch: Any) -> torch.Tensor:
    ids = _ids(batch)
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 2:].reshape(-1))


class _Rows:
    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = torch.from_numpy(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index]}


def workload(config: Mapping[str, Any]) -> dict[str, Any]:
    length = int(config.get("length", 129))
    model = TokenLM()
    return {
        "model": model,
        "train": None,
        "val": _Rows(token_rows(64, length, seed=999)),
        "batch_size": int(config.get("batch_size", 8)),
        "loss": loss,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=3e-3),
        "name": "tokens",
    }
